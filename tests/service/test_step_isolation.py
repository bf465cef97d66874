"""A step that fails because of one request must fail that request only (a real gRPC server on loopback).

The failure is forced by a model hook: the target's tree pass raises while a running row samples with
``top_k == POISON_TOP_K`` (a valid value no other request uses), as a device fault tied to one sequence would.
The server drafts on the device (the model drafts for itself), so every step is a tree pass, and the failure
comes before the step moved any state: the engine runs the step again with one sequence at a time set aside,
ends the one that makes it fail, and the others take their step. A request the engine ended with an error
gets INTERNAL with a plain sentence (never OK with ``finish_reason`` "error"), and the server keeps serving.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from service_helpers import TinyStack, grpc_served, wait_until
from stree.proto.stree.v1 import common_pb2, generation_pb2
from stree.verifier.decode.loop import generate
from stree.verifier.service.drafters import EmbeddedDrafters
from stree.verifier.service.server import GenerationServer, ServerLimits

POISON_TOP_K = 13
N_NEW = 1500  # long enough that the bystanders are still running when the culprit joins
PROMPTS = [[(5 * i + k) % 60 + 1 for k in range(3 + i)] for i in range(6)]


def poison(model, engine_of):
    """Make ``model``'s tree pass raise while a running row of ``engine_of()`` has top_k == POISON_TOP_K."""
    base = type(model)

    class Poisoned(base):
        def tree_forward(self, *args, **kwargs):
            program = engine_of().program
            if bool((~program.idle & (program.sampling.top_k == POISON_TOP_K)).any()):
                raise RuntimeError("device fault in the row with top_k 13")
            return base.tree_forward(self, *args, **kwargs)

    model.__class__ = Poisoned
    return model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=31, n_layer=1)
    s.want = generate(s.model, PROMPTS, max_new_tokens=N_NEW)  # before the hook: the plain greedy outputs
    s.want = [o.token_ids for o in s.want]
    s.server = GenerationServer(s.model, s.tok, EmbeddedDrafters("mamba", draft_model=s.model,
                                                                  options={"tree": "chain:2"}),
                                limits=ServerLimits(max_sessions=8, max_seq_len=4096))
    poison(s.model, lambda: s.server.core.engine)
    with grpc_served(s.server) as (s.channel, s.stub):
        yield s


def _culprit() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[7, 8, 9]), max_new_tokens=50,
                                          sampling=common_pb2.SamplingParams(temperature=1.0, top_k=POISON_TOP_K))


def _run_with_culprit(stack, bystanders: int) -> tuple[dict, tuple]:
    """``bystanders`` greedy streams, then the culprit once they all run: each one's (status, details, tokens)."""
    results: dict = {}

    def bystander(i):
        req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=PROMPTS[i]),
                                             max_new_tokens=N_NEW, ignore_eos=True)
        tokens = []
        try:
            for chunk in stack.stub.Generate(req, timeout=300):
                tokens += chunk.token_ids
            results[i] = (grpc.StatusCode.OK, "", tokens)
        except grpc.RpcError as exc:
            results[i] = (exc.code(), exc.details(), tokens)

    threads = [threading.Thread(target=bystander, args=(i,)) for i in range(bystanders)]
    for t in threads:
        t.start()
    assert wait_until(lambda: stack.server.core.scheduler.num_running == bystanders)
    try:
        stack.stub.GenerateUnary(_culprit(), timeout=120)
        culprit = (grpc.StatusCode.OK, "")
    except grpc.RpcError as exc:
        culprit = (exc.code(), exc.details())
    for t in threads:
        t.join(300)
    assert wait_until(lambda: stack.server.active_sessions() == 0)
    return results, culprit


def test_a_request_the_engine_fails_ends_internal_never_ok(stack):
    results, culprit = _run_with_culprit(stack, 2)
    assert culprit[0] == grpc.StatusCode.INTERNAL and "step failed" in culprit[1], culprit
    for i, (code, details, tokens) in results.items():
        if code == grpc.StatusCode.OK:
            assert tokens == stack.want[i]
        else:
            assert code == grpc.StatusCode.INTERNAL and details and "Traceback" not in details
    out = stack.stub.GenerateUnary(generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(
        ids=PROMPTS[0]), max_new_tokens=8), timeout=60)
    assert list(out.token_ids) == stack.want[0][:8]


def test_only_the_culprit_fails_and_six_bystanders_finish_exact(stack):
    results, culprit = _run_with_culprit(stack, 6)
    assert culprit[0] == grpc.StatusCode.INTERNAL, culprit
    assert {i: r[0] for i, r in results.items()} == {i: grpc.StatusCode.OK for i in range(6)}
    assert [results[i][2] for i in range(6)] == stack.want
