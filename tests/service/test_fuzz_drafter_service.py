"""Hypothesis fuzzing of the DrafterService's requests on a real loopback server (random field values and random
bytes): only documented statuses come back, messages carry no internals, and good requests still work after."""

from __future__ import annotations

import grpc
import pytest

pytest.importorskip("ray")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from service_helpers import drafter_service  # noqa: E402
from stream_helpers import CLOSE, draft_req, open_req  # noqa: E402

from stree.drafter_service.service import ServiceLimits  # noqa: E402
from stree.proto.stree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc  # noqa: E402

S = grpc.StatusCode
# What a stream may end with (docs/protocol): OK, or a refusal naming the field and the limit.
DOCUMENTED = {S.OK, S.INVALID_ARGUMENT, S.OUT_OF_RANGE, S.RESOURCE_EXHAUSTED, S.FAILED_PRECONDITION}
LEAKS = ("Traceback", "Error(", ".py", "pid=", "0x", "ray::")
LIMITS = ServiceLimits(max_context_tokens=4096, max_sessions=64, max_sessions_per_client=64)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=False)


@pytest.fixture(scope="module")
def channel():
    with drafter_service(["ngram"], limits=LIMITS) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            yield ch


def _run(channel, payloads, raw: bool):
    """Send ``payloads`` on one stream; (final status, details, answers)."""
    if raw:
        call = channel.stream_stream("/stree.v1.DrafterService/Session", request_serializer=None,
                                     response_deserializer=drafter_pb2.DrafterResponse.FromString)
    else:
        call = drafter_pb2_grpc.DrafterServiceStub(channel).Session
    answers = []
    try:
        for answer in call(iter(payloads), timeout=60):
            answers.append(answer)
        return S.OK, "", answers
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", answers


def _check(code, details, answers):
    assert code in DOCUMENTED, (code, details)
    for text in [details] + [a.error.message for a in answers if a.WhichOneof("kind") == "error"]:
        assert not any(leak in text for leak in LEAKS), text
    for a in answers:
        if a.WhichOneof("kind") == "error":
            assert a.error.code in drafter_pb2.DrafterError.Code.values()


u32 = st.integers(0, 2**32 - 1)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-300, 1e-3, 1.0, -1.0]))
sampling = st.builds(common_pb2.SamplingParams, temperature=floats, top_k=u32,
                     top_p=st.one_of(st.none(), floats), seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
budget = st.builds(common_pb2.DraftBudget, max_nodes=u32, max_depth=u32, max_width=u32)
opens = st.builds(drafter_pb2.OpenSession, session_id=st.text(max_size=80),
                  prompt_ids=st.lists(st.one_of(st.integers(0, 70), u32), max_size=300),
                  drafter=st.sampled_from(["ngram", "", "nope", "chain", "ngram\x00", "../ngram"]),
                  budget=st.one_of(st.none(), budget), sampling=st.one_of(st.none(), sampling))
commits = st.builds(drafter_pb2.CommitTokens, tokens=st.lists(u32, max_size=50), context_length=st.integers(0, 2**64 - 1))
drafts = st.builds(drafter_pb2.DraftRequest, request_id=st.integers(0, 2**64 - 1),
                   context_length=st.integers(0, 2**64 - 1), budget=st.one_of(st.none(), budget))
requests = st.one_of(
    st.builds(drafter_pb2.DrafterRequest, open=opens), st.builds(drafter_pb2.DrafterRequest, commit=commits),
    st.builds(drafter_pb2.DrafterRequest, draft=drafts), st.just(CLOSE), st.just(drafter_pb2.DrafterRequest()))


@FUZZ
@given(first=opens, rest=st.lists(requests, max_size=6))
def test_random_field_values_get_documented_answers(channel, first, rest):
    _check(*_run(channel, [drafter_pb2.DrafterRequest(open=first)] + rest, raw=False))


@FUZZ
@given(payloads=st.lists(st.binary(max_size=96), min_size=1, max_size=4))
def test_random_bytes_get_documented_answers(channel, payloads):
    _check(*_run(channel, payloads, raw=True))


def test_a_good_session_works_after_the_fuzzing(channel):
    prompt = [5, 6, 5, 6, 5]
    code, details, answers = _run(channel, [open_req(prompt), draft_req(1, len(prompt)), CLOSE], raw=False)
    assert code == S.OK, details
    kinds = [a.WhichOneof("kind") for a in answers]
    assert kinds == ["opened", "tree"]
    assert list(answers[1].tree.tokens)[:2] == [5, 6] and answers[1].tree.context_length == len(prompt)
