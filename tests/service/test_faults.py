"""Faults on the remote drafter path: output never changes, and drafting comes back after each fault.

Covered: a replica killed mid-generation (for good, and restartable by Ray), the DrafterService
stopped and started again mid-generation, a drafter stalling past the verifier's deadline, and
drafters that hand back malformed trees (through the service, and raw on the wire).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
import torch

ray = pytest.importorskip("ray")

import stree  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.drafter_service.drafters.mamba.drafter import make_chain_drafter  # noqa: E402
from service_helpers import drafter_service, stream_through_fault, wait_until  # noqa: E402
from stree.drafter_service.service import DrafterServer  # noqa: E402
from stree.proto.stree.v1 import drafter_pb2, drafter_pb2_grpc  # noqa: E402
from stree.protocols import DraftBudget, DraftMode, SamplingParams, TokenTree, register_drafter  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.remote_drafter import DraftUnavailable, RemoteDrafter  # noqa: E402
from stree.verifier.service.server import GenerationServer, RemoteDrafters, ServerLimits  # noqa: E402

BUDGET = DraftBudget(max_nodes=8, max_depth=4, max_width=2)
PROMPT = [7, 3, 19, 3, 44]
VOCAB = 64
MAX_SEQ = 4096
STALL_S = 1.0
DEADLINE_S = 0.3


class _Wrapped:
    """A chain-oracle session (the target as its own draft model) whose ``draft`` a subclass perturbs."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def commit(self, tokens):
        self.inner.commit(tokens)

    def close(self):
        self.inner.close()


class StallSession(_Wrapped):
    def draft(self, budget):
        self.calls += 1
        if self.calls in (2, 5):
            time.sleep(STALL_S)
        return self.inner.draft(budget)


class MalformedSession(_Wrapped):
    """Odd calls: a good tree. Even calls: a different defect each time, the last one raising."""

    def draft(self, budget):
        self.calls += 1
        good = self.inner.draft(budget)
        root = int(good.tokens[0])
        defect = {
            2: lambda: TokenTree.chain([root] + [1] * (budget.max_nodes + 3)),  # over budget
            4: lambda: TokenTree.chain([root, 10**6]),  # outside the vocabulary
            6: lambda: TokenTree.chain([(root + 1) % VOCAB, 1]),  # wrong root
            8: lambda: SimpleNamespace(tokens=[root, 1, 2], parents=[-1, 2, 0]),  # parent after child
            10: lambda: TokenTree([root, 1], [-1, 0], torch.full((2, VOCAB + 1), 1.0 / (VOCAB + 1)), DraftMode.IID),
        }
        if self.calls == 12:
            raise RuntimeError("plugin bug")
        return defect.get(self.calls, lambda: good)()


def _factory(session_cls):
    def make(draft_model=None, **_):
        inner = make_chain_drafter(draft_model=draft_model, num_speculative_tokens=4)
        return SimpleNamespace(name=session_cls.__name__, open=lambda p, params: session_cls(inner.open(p, params)))

    return make


register_drafter("test-stall", _factory(StallSession), replace=True)
register_drafter("test-malformed", _factory(MalformedSession), replace=True)


class Stack:
    pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack()
    s.model_dir = init_model(tmp_path_factory.mktemp("m") / "tiny", arch="mamba2", d_model=32, n_layer=2,
                             vocab_size=VOCAB, seed=5)
    s.model = load_model(s.model_dir)
    s.loop = shared_loop()
    service = drafter_service(["chain", "test-stall", "test-malformed"], replicas=2,
                              options_for=lambda name: {"draft_model": str(s.model_dir)}, test_module=__name__)
    s.drafters = service.__enter__()
    s.server = GenerationServer(
        s.model, None, RemoteDrafters(f"grpc://{s.drafters.address}/chain", DEADLINE_S, BUDGET),
        limits=ServerLimits(max_sessions=4, max_seq_len=MAX_SEQ, budget=BUDGET),
    )
    s.loop.run(s.server.start())
    s.client = stree.Client(s.server.address, timeout=300)
    yield s
    s.client.close()
    s.loop.run(s.server.stop(0), 30)
    service.__exit__(None, None, None)


def _plain(stack, n, prompt=PROMPT):
    return generate(stack.model, prompt, drafter=None, max_new_tokens=n).token_ids


def _stream_through_fault(stack, inject, drafter="chain"):
    return stream_through_fault(stack.client, PROMPT, MAX_SEQ - 64, inject, drafter)


def test_replica_killed_for_good_mid_generation(stack):
    pool = stack.drafters.host.pools["chain"]
    killed = {}

    def kill():
        holder = next(r for r in pool.replicas if r.sessions)
        killed["replica"], killed["name"] = holder, holder.actor_name
        ray.kill(holder.handle)  # no restart: the pool must replace it

    tokens, fallbacks, recovered = _stream_through_fault(stack, kill)
    assert fallbacks >= 1 and recovered, "the session should move to the live replica and draft again"
    assert tokens == _plain(stack, len(tokens))
    holder = killed["replica"]
    assert wait_until(lambda: not holder.replacing and holder.actor_name != killed["name"])
    assert ray.get(holder.handle.info.remote())["name"] == "chain"
    out = stack.client.generate(prompt_ids=PROMPT, max_new_tokens=40)
    assert out.token_ids == _plain(stack, 40) and out.stats["accepted_draft_tokens"] > 0


def test_replica_restarted_by_ray_mid_generation(stack):
    pool = stack.drafters.host.pools["chain"]

    def crash():
        holder = next(r for r in pool.replicas if r.sessions)
        ray.kill(holder.handle, no_restart=False)  # Ray restarts it (max_restarts), empty

    tokens, fallbacks, recovered = _stream_through_fault(stack, crash)
    assert fallbacks >= 1 and recovered
    assert tokens == _plain(stack, len(tokens))


def test_drafter_service_stopped_and_restarted_mid_generation(stack):
    old = stack.drafters
    port = old.port

    def stop():
        stack.loop.run(old.stop(grace=0, shutdown_pools=False), 30)

    stream = stack.client.stream(prompt_ids=PROMPT, max_new_tokens=MAX_SEQ - 64)
    tokens, phase, outage_fallbacks = [], "before", 0
    try:
        for chunk in stream:
            tokens += chunk.token_ids
            step = chunk.step
            if phase == "before" and step.get("accepted", 0) > 0:
                stop()
                phase = "down"
            elif phase == "down" and step.get("fallback"):
                outage_fallbacks += 1
                if outage_fallbacks == 3:  # the verifier kept going without drafts; bring the service back
                    stack.drafters = DrafterServer(port=port, host=old.host)
                    stack.loop.run(stack.drafters.start(), 60)
                    phase = "up"
            elif phase == "up" and step.get("accepted", 0) > 0:
                phase = "recovered"
                break
    finally:
        stream.close()
    assert phase == "recovered", f"drafting did not resume (phase {phase})"
    assert tokens == _plain(stack, len(tokens))
    out = stack.client.generate(prompt_ids=PROMPT, max_new_tokens=40)
    assert out.token_ids == _plain(stack, 40) and out.stats["accepted_draft_tokens"] > 0


def test_drafter_stalling_past_the_deadline(stack):
    out = stack.client.generate(prompt_ids=PROMPT, max_new_tokens=60, drafter="test-stall")
    assert out.token_ids == _plain(stack, 60)
    assert out.stats["fallbacks"] >= 1  # the stalled drafts missed the deadline
    assert out.stats["accepted_draft_tokens"] > 0  # and the others were used


def test_drafter_returning_malformed_trees(stack):
    out = stack.client.generate(prompt_ids=PROMPT, max_new_tokens=80, drafter="test-malformed")
    assert out.token_ids == _plain(stack, 80)
    assert out.stats["fallbacks"] >= 5
    assert out.stats["accepted_draft_tokens"] > 0


class GarbageDrafterService(drafter_pb2_grpc.DrafterServiceServicer):
    """Speaks the protocol but answers every Draft with a structurally broken tree."""

    async def Session(self, request_iterator, context):
        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "open":
                yield drafter_pb2.DrafterResponse(opened=drafter_pb2.SessionOpened(session_id="g"))
            elif kind == "draft":
                d = req.draft
                yield drafter_pb2.DrafterResponse(tree=drafter_pb2.DraftTree(
                    request_id=d.request_id, context_length=d.context_length, tokens=[1, 2, 3], parents=[-1, 0],
                    draft_probs=b"\x01\x02", vocab_size=7))


def test_raw_malformed_trees_on_the_wire(stack):
    loop = stack.loop

    async def start():
        server = grpc.aio.server()
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(GarbageDrafterService(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    remote = RemoteDrafter(f"grpc://127.0.0.1:{port}/anything", deadline_s=5.0)
    try:
        session = remote.open(PROMPT, SamplingParams(), budget=BUDGET)
        with pytest.raises(DraftUnavailable, match="malformed tree"):
            session.draft(BUDGET)
        session.close()
        out = generate(stack.model, PROMPT, drafter=remote, max_new_tokens=12, budget=BUDGET)
        assert out.token_ids == _plain(stack, 12)
        assert out.stats["drafter_fallbacks"] == out.stats["steps"]
    finally:
        remote.close()
        loop.run(server.stop(0))


def test_drafter_service_down_from_the_start(stack):
    """Nothing listens at the drafter address: every step falls back, output is unchanged."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections are refused
    remote = RemoteDrafter(f"grpc://127.0.0.1:{port}/chain", deadline_s=0.2, open_timeout_s=2.0)
    try:
        out = generate(stack.model, PROMPT, drafter=remote, max_new_tokens=10, budget=BUDGET)
        assert out.token_ids == _plain(stack, 10)
        assert out.stats["drafter_fallbacks"] == out.stats["steps"]
    finally:
        remote.close()
