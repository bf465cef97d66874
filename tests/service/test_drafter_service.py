"""DrafterService on a real local Ray instance: remote trees equal in-process ones, sessions spread and stay apart."""

from __future__ import annotations

import threading

import grpc
import pytest

ray = pytest.importorskip("ray")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (  # noqa: E402
    ProtoReflectionDescriptorDatabase,
)

from stree.cli.drafter_service import options_function, parse_options  # noqa: E402
from stree.proto.rpc import add_health_and_reflection, set_serving  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from service_helpers import drafter_service, wait_until  # noqa: E402
from stree.proto.stree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc  # noqa: E402
from stree.protocols import DraftBudget, SamplingParams, TokenTree, create_drafter, register_drafter  # noqa: E402
from stree.protocols.drafter import ContextSession, HostDrafter  # noqa: E402
from stree.verifier.service.remote_drafter import DraftUnavailable, RemoteDrafter, parse_drafter_url  # noqa: E402

BUDGET = DraftBudget(max_nodes=16, max_depth=4, max_width=4)


class FingerprintSession(ContextSession):
    """Drafts a chain that encodes its own context (length and checksum), so mixed-up sessions show."""

    def draft(self, budget):
        return TokenTree.chain([self.context[-1], len(self.context) % 1000, sum(self.context) % 1000])


class FingerprintDrafter(HostDrafter):
    name = "fingerprint"

    def open(self, prompt_ids, params):
        return FingerprintSession(prompt_ids, params)


register_drafter("fingerprint", lambda **_: FingerprintDrafter(), replace=True)


@pytest.fixture(scope="module")
def service():
    # Ray workers cannot import this test module: ship its drafter classes by value.
    with drafter_service(["ngram", "fingerprint"], replicas=2, test_module=__name__) as srv:
        yield srv


@pytest.fixture(scope="module")
def remote(service):
    drafter = RemoteDrafter(service.address, "ngram", deadline_s=10.0)
    yield drafter
    drafter.close()


def test_remote_ngram_trees_equal_in_process_ones(remote):
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3
    prompt, rest = text[:25], text[25:]
    params = SamplingParams()
    local = create_drafter("ngram").open(prompt, params)
    far = remote.open(prompt, params, budget=BUDGET)
    try:
        accepted_any = False
        while rest:
            a, b = local.draft(BUDGET), far.draft(BUDGET)
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            accepted_any |= b.num_nodes > 1
            step, rest = rest[:3], rest[3:]
            local.commit(step)
            far.commit(step)
        assert accepted_any, "the n-gram drafter should find repeats in this text"
        assert far.stats["prefetched"] > 0 and far.stats["timeouts"] == 0
    finally:
        far.close()


def test_concurrent_sessions_spread_over_replicas_and_do_not_mix(service):
    drafter = RemoteDrafter(f"grpc://{service.address}/fingerprint", deadline_s=10.0)
    sessions = [drafter.open([10 + i], SamplingParams(), budget=BUDGET) for i in range(4)]
    pool = service.host.pools["fingerprint"]
    assert sorted(len(r.sessions) for r in pool.replicas) == [2, 2]
    errors = []

    def drive(k, session):
        try:
            for step in range(25):
                tree = session.draft(BUDGET)
                ctx = session.context
                assert tree.tokens.tolist() == [ctx[-1], len(ctx) % 1000, sum(ctx) % 1000]
                session.commit([k * 7 + step, k])
        except Exception as exc:  # reported below with the session number
            errors.append((k, repr(exc)))

    threads = [threading.Thread(target=drive, args=(k, s)) for k, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for s in sessions:
        s.close()
    assert wait_until(lambda: pool.num_sessions() == 0 and service.active_sessions() == 0)
    drafter.close()


def test_pipelining_prefetches_and_drops_stale_trees(remote):
    session = remote.open([1, 2, 3, 1, 2], SamplingParams(), budget=BUDGET)
    try:
        assert session.draft(BUDGET).tokens[0] == 2  # the tree prefetched with Open
        # Two commits in a row: the Draft sent after the first is stale by the time it is answered.
        session.commit([3])
        session.commit([1, 2])
        # The Draft sent with the last Commit is answered while the verifier does other work.
        assert wait_until(lambda: session.tree_ready(BUDGET))
        tree = session.draft(BUDGET)
        assert int(tree.tokens[0]) == 2 and tree.tokens.tolist()[1:2] == [3]  # drafted from the full context
        assert session.stats["prefetched"] >= 3 and session.stats["prefetch_hits"] >= 1
        # A different budget is a new request; the prefetched tree is not reused for it.
        small = session.draft(DraftBudget(max_nodes=2, max_depth=1, max_width=1))
        assert small.num_nodes <= 2
    finally:
        session.close()


def test_unknown_drafter_and_bad_urls_are_refused(service, remote):
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        remote.with_drafter("nope").open([1, 2], SamplingParams())
    for bad in ("grpc://host/ngram", "http://h:1/ngram", "grpc://h:1/", "grpc://h:1/a/b"):
        with pytest.raises(ValueError, match="grpc://HOST:PORT/NAME|needs a port"):
            parse_drafter_url(bad)
    assert parse_drafter_url("grpc://10.0.0.1:7000/ngram") == ("10.0.0.1:7000", "ngram")


def _raw_session(service, requests):
    with grpc.insecure_channel(service.address) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        return list(stub.Session(iter(requests), timeout=30))


def _open(prompt=(1, 2, 3), drafter="ngram", **sampling):
    return drafter_pb2.DrafterRequest(open=drafter_pb2.OpenSession(
        session_id="raw", prompt_ids=list(prompt), drafter=drafter, sampling=common_pb2.SamplingParams(**sampling)))


@pytest.mark.parametrize(
    "requests, needle",
    [
        ([drafter_pb2.DrafterRequest(close=drafter_pb2.CloseSession())], "first message of a session must be Open"),
        ([_open(prompt=())], "at least one token"),
        ([_open(temperature=-0.5)], "temperature"),
        ([_open(drafter="missing")], "unknown drafter"),
        ([_open(), drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitTokens(tokens=[4], context_length=9))],
         "context_length 9"),
    ],
)
def test_protocol_misuse_is_invalid_argument(service, requests, needle):
    with pytest.raises(grpc.RpcError) as info:
        _raw_session(service, requests)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


def _draft(rid, length):
    return drafter_pb2.DrafterRequest(draft=drafter_pb2.DraftRequest(request_id=rid, context_length=length))


def _commit(tokens, length):
    return drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitTokens(tokens=tokens, context_length=length))


def test_raw_stream_answers_the_newest_draft_and_per_draft_errors(service):
    close = drafter_pb2.DrafterRequest(close=drafter_pb2.CloseSession())
    answers = _raw_session(service, [_open(prompt=(5, 6, 5)), _draft(1, 3), _commit([6], 4), _draft(2, 4), close])
    assert answers[0].WhichOneof("kind") == "opened"
    trees = [a.tree for a in answers if a.WhichOneof("kind") == "tree"]
    # Draft 1 may be skipped (the Commit behind it made it stale); draft 2 is always answered.
    assert trees[-1].request_id == 2 and trees[-1].context_length == 4
    assert list(trees[-1].tokens)[:2] == [6, 5]
    answers = _raw_session(service, [_open(prompt=(5, 6, 5)), _draft(7, 99), close])
    errors = [a.error for a in answers if a.WhichOneof("kind") == "error"]
    assert [(e.request_id, e.code) for e in errors] == [(7, drafter_pb2.DrafterError.INVALID_ARGUMENT)]
    assert "context_length 99" in errors[0].message


def test_health_and_reflection(service):
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "stree.v1.DrafterService"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"stree.v1.DrafterService", "grpc.health.v1.Health"} <= services
        assert db.FindFileContainingSymbol("stree.v1.DrafterService").name == "stree/v1/drafter.proto"


def test_draft_after_close_is_unavailable(remote):
    session = remote.open([1, 2, 3], SamplingParams(), budget=BUDGET)
    session.close()
    with pytest.raises(DraftUnavailable):
        session.draft(BUDGET)


def test_cli_option_parsing():
    opts = parse_options(["tree=beam:4x3", "chain.num_speculative_tokens=6", 'fusion.drafters=["ngram","retrieval"]'])
    assert opts == {"*": {"tree": "beam:4x3"}, "chain": {"num_speculative_tokens": 6},
                    "fusion": {"drafters": ["ngram", "retrieval"]}}
    options_for = options_function("/models/draft", opts)
    assert options_for("chain") == {"draft_model": "/models/draft", "tree": "beam:4x3", "num_speculative_tokens": 6}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["novalue"])


def test_health_says_not_serving_until_set_serving(service):
    """The health servicer reports "" SERVING by default; servers flip it only once ready."""
    loop = shared_loop()
    names = ["stree.v1.DrafterService"]

    async def start():
        server = grpc.aio.server()
        health = add_health_and_reflection(server, names)
        await set_serving(health, names, serving=False)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, health, port

    server, health, port = loop.run(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = lambda name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status  # noqa: E731
            assert check("") == check(names[0]) == health_pb2.HealthCheckResponse.NOT_SERVING
            loop.run(set_serving(health, names))
            assert check("") == check(names[0]) == health_pb2.HealthCheckResponse.SERVING
    finally:
        loop.run(server.stop(0))
