"""One client cannot hurt another on a real loopback DrafterService: no session hijack, bounded contexts,
sessions and drafters, documented status codes with clean messages, no sessions left after a stall."""

from __future__ import annotations

import os
import time

import grpc
import pytest

ray = pytest.importorskip("ray")

from service_helpers import drafter_service, wait_until  # noqa: E402
from stream_helpers import CLOSE, RawStream, commit_req, draft_req, open_req  # noqa: E402

from stree.drafter_service.actors import PoolConfig  # noqa: E402
from stree.drafter_service.service import DrafterServer, ServiceLimits  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.proto.stree.v1 import drafter_pb2  # noqa: E402
from stree.protocols import TokenTree, register_drafter  # noqa: E402
from stree.protocols.drafter import ContextSession  # noqa: E402

LIMITS = ServiceLimits(max_context_tokens=1000, max_sessions=64, max_sessions_per_client=6)


class EchoSession(ContextSession):
    """Drafts [last token, context length % 1000]: a tree that shows whose context it came from."""

    def draft(self, budget):
        return TokenTree.chain([self.context[-1], len(self.context) % 1000])


class BrittleSession(ContextSession):
    def draft(self, budget):
        raise RuntimeError(f"internal detail /srv/secret/path.py pid {os.getpid()} at 10.1.2.3:6379")


class SleepySession(ContextSession):
    """The first draft anywhere (marked by a file) stalls ``seconds``: a replica that stops answering."""

    marker = ""
    seconds = 4.0

    def draft(self, budget):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            time.sleep(self.seconds)
        except FileExistsError:
            pass
        return TokenTree.chain([self.context[-1]])


def _drafter(session_cls, **attrs):
    class Drafter:
        name = session_cls.__name__

        def open(self, prompt_ids, params):
            session = session_cls(prompt_ids, params)
            for k, v in attrs.items():
                setattr(session, k, v)
            return session

    return Drafter()


register_drafter("echo", lambda **_: _drafter(EchoSession), replace=True)
register_drafter("brittle", lambda **_: _drafter(BrittleSession), replace=True)
register_drafter("sleepy", lambda marker, **_: _drafter(SleepySession, marker=marker), replace=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    marker = str(tmp_path_factory.mktemp("sleepy") / "stalled-once")
    with drafter_service(["echo", "brittle", "ngram"], replicas=1, test_module=__name__, limits=LIMITS,
                         options_for=lambda name: {"marker": marker}) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(service):
    with grpc.insecure_channel(service.address) as ch:
        yield ch


def _status(channel, *requests) -> grpc.RpcError:
    stream = RawStream(channel).send(*requests)
    stream.end()
    with pytest.raises(grpc.RpcError) as info:
        while True:
            stream.recv()
    return info.value


def test_same_client_session_id_on_two_streams_cannot_take_over(channel):
    a = RawStream(channel).send(open_req((1, 2, 3), "echo", session_id="same"))
    id_a = a.recv().opened.session_id
    b = RawStream(channel).send(open_req((5, 6, 7, 8, 9), "echo", session_id="same"))
    id_b = b.recv().opened.session_id
    assert id_a != id_b and "same" not in (id_a, id_b)  # issued by the server
    a.send(draft_req(1, 3))
    b.send(draft_req(1, 5))
    tree_a, tree_b = a.recv(), b.recv()
    assert tree_a.WhichOneof("kind") == "tree" and list(tree_a.tree.tokens) == [3, 3]
    assert tree_b.WhichOneof("kind") == "tree" and list(tree_b.tree.tokens) == [9, 5]
    a.send(CLOSE), b.send(CLOSE)
    a.end(), b.end()


def test_context_beyond_the_limit_is_refused_naming_it(channel):
    err = _status(channel, open_req([7] * 1001, "echo"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_ids has 1001 tokens" in err.details() and "limit of 1000" in err.details()
    err = _status(channel, open_req([7] * 999, "echo"), commit_req([1, 2], 1001))
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "limit of 1000" in err.details()


def test_huge_open_is_refused_before_it_is_buffered(channel):
    err = _status(channel, open_req([100_000] * 2_000_000, "echo"))  # ~8 MB on the wire
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_only_served_drafters_open(channel, service):
    err = _status(channel, open_req((1, 2), "chain"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'chain' is not served here" in err.details()
    assert sorted(service.host.pools) == ["brittle", "echo", "ngram"]


def test_sessions_per_client_are_bounded(channel):
    streams = []
    for _ in range(LIMITS.max_sessions_per_client):
        streams.append(RawStream(channel).send(open_req((1, 2), "echo")))
        assert streams[-1].recv().WhichOneof("kind") == "opened"
    err = _status(channel, open_req((1, 2), "echo"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per-client limit" in err.details()
    for s in streams:
        s.send(CLOSE)
        s.end()


@pytest.mark.parametrize("field, value, limit", [("temperature", 1e-300, ">= 0.001"), ("top_p", 1e-300, ">= 1e-06")])
def test_underflowing_sampling_values_are_invalid_argument(channel, field, value, limit):
    err = _status(channel, open_req((1, 2), "echo", **{field: value}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details() and limit in err.details()


def _open_bytes(session_id: bytes) -> bytes:
    raw = open_req((1, 2), "echo", session_id="Z").SerializeToString()
    return raw.replace(b"\x0a\x01Z", b"\x0a" + bytes([len(session_id)]) + session_id)


@pytest.mark.parametrize("payload", [b"\x0a\xff\x01", b"\xff\xff\xff\xff", _open_bytes(b"\xff\xfe")],
                         ids=["truncated", "bad-tag", "invalid-utf8"])
def test_malformed_protobuf_is_invalid_argument(channel, payload):
    call = channel.stream_stream("/stree.v1.DrafterService/Session", request_serializer=None,
                                 response_deserializer=drafter_pb2.DrafterResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(call(iter([payload]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid stree.v1.DrafterRequest" in info.value.details()


def test_drafter_errors_carry_no_class_names_paths_pids_or_addresses(channel):
    stream = RawStream(channel).send(open_req((1, 2, 3), "brittle"), draft_req(1, 3))
    assert stream.recv().WhichOneof("kind") == "opened"
    error = stream.recv().error
    assert error.code == drafter_pb2.DrafterError.DRAFTER_FAILED
    assert "'brittle' failed to draft" in error.message
    for leak in ("Error", "/srv", "pid", "10.1.2.3", "Traceback", ".py"):
        assert leak not in error.message
    stream.send(CLOSE)
    stream.end()


def _replica_sessions(server) -> int:
    return sum(ray.get(r.handle.num_sessions.remote()) for p in server.host.pools.values() for r in p.replicas)


def test_no_session_is_left_on_a_replica_that_stalled(service, channel):
    """A replica stalls past the call timeout: the session moves on, and the stalled copy is closed."""
    loop = shared_loop()
    options = service.host.options_for
    stalling = DrafterServer(port=0, drafters=["sleepy"], pool_config=PoolConfig(replicas=2), call_timeout_s=1.0,
                             options_for=options)
    loop.run(stalling.start(), 240)
    try:
        with grpc.insecure_channel(stalling.address) as ch:
            stream = RawStream(ch).send(open_req((4, 5, 6), "sleepy"), draft_req(1, 3))
            assert stream.recv().WhichOneof("kind") == "opened"
            assert stream.recv().error.code == drafter_pb2.DrafterError.UNAVAILABLE  # stalled past 1 s
            assert wait_until(lambda: stalling.host.pools["sleepy"].replicas[0].sessions.isdisjoint(
                stalling.host.pools["sleepy"].replicas[1].sessions), 30)
            for rid in range(2, 200):  # drafting resumes once the session is re-opened elsewhere
                answer = stream.send(draft_req(rid, 3)).recv()
                if answer.WhichOneof("kind") == "tree":
                    break
                time.sleep(0.1)
            assert answer.WhichOneof("kind") == "tree"
            assert wait_until(lambda: _replica_sessions(stalling) == 1, 30), _replica_sessions(stalling)
            stream.send(CLOSE)
            stream.end()
            assert wait_until(lambda: _replica_sessions(stalling) == 0, 30)
    finally:
        loop.run(stalling.stop(0), 30)
