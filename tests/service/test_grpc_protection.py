"""The GenerationService is as protected as the HTTP API (a real server on loopback): the API key guards every
method but health (reflection too), requests are held to the same bounds (a temperature of 1e308 used to pass
and fail the whole batch), every refusal is INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming its field or limit
with little of the value echoed, a client's cap is counted before its stream starts, and a plugin whose
``open`` raises gives INTERNAL with a plain sentence, not UNKNOWN with a class name."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service_helpers import TinyStack, grpc_served, wait_until
from stree.proto.stree.v1 import common_pb2, generation_pb2
from stree.protocols import HostDrafter
from stree.protocols.registry import register_drafter
from stree.verifier.decode.loop import generate
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits

KEY = "grpc-sekrit"
AUTH = (("authorization", f"Bearer {KEY}"),)
S = grpc.StatusCode


class _OpenRaises(HostDrafter):
    """A plugin whose ``open`` fails with a message holding a path and a class name."""

    name = "open-raises"

    def open(self, prompt_ids, params):
        raise RuntimeError("cannot map /opt/plugins/weights.bin: <class 'OSError'>")


register_drafter("open-raises", lambda **_: _OpenRaises(), replace=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=21, n_layer=1)
    s.server = GenerationServer(s.model, s.tok, EmbeddedDrafters("host-ngram"), api_key=KEY, model_name="tiny",
                                limits=ServerLimits(max_sessions=2, max_waiting=8, max_seq_len=4096,
                                                    max_streams_per_client=2))
    with grpc_served(s.server) as (s.channel, s.stub):
        yield s


def _req(**kw) -> generation_pb2.GenerateRequest:
    kw.setdefault("prompt_ids", generation_pb2.TokenIds(ids=[5, 6, 7]))
    kw.setdefault("max_new_tokens", 4)
    return generation_pb2.GenerateRequest(**kw)


def _status(fn, *args, **kw):
    try:
        out = fn(*args, **kw)
        if not isinstance(out, generation_pb2.GenerateResponse):
            list(out)
        return S.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


def test_every_method_but_health_needs_the_key(stack):
    assert _status(stack.stub.GenerateUnary, _req(), timeout=30)[0] == S.UNAUTHENTICATED
    assert _status(stack.stub.Generate, _req(), timeout=30)[0] == S.UNAUTHENTICATED
    assert _status(stack.stub.GenerateUnary, _req(), timeout=30,
                   metadata=(("authorization", "Bearer wrong"),))[0] == S.UNAUTHENTICATED
    reflect = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as err:
        list(reflect.ServerReflectionInfo(iter([ask]), timeout=30))
    assert err.value.code() == S.UNAUTHENTICATED
    listed = list(reflect.ServerReflectionInfo(iter([ask]), timeout=30, metadata=AUTH))
    assert "stree.v1.GenerationService" in {s.name for s in listed[0].list_services_response.service}
    health = health_pb2_grpc.HealthStub(stack.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = stack.stub.GenerateUnary(_req(), timeout=60, metadata=AUTH)
    assert list(out.token_ids) == generate(stack.model, [5, 6, 7], max_new_tokens=4).token_ids


@pytest.mark.parametrize("request_kw, field", [
    (dict(sampling=common_pb2.SamplingParams(temperature=1e308)), "sampling.temperature"),
    (dict(sampling=common_pb2.SamplingParams(temperature=2.5)), "sampling.temperature"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["ab"] * 1000), "stop"),
    (dict(stop=["x" * 1_000_000]), "stop"),
    (dict(request_id="r1\nINFO request_id=forged finished"), "request_id"),
    (dict(drafter="d" * 100_000), "drafter"),
    (dict(prompt_ids=generation_pb2.TokenIds(ids=[3, 64])), "prompt_ids"),
    (dict(stop_token_ids=list(range(100))), "stop_token_ids"),
])
def test_out_of_bounds_requests_are_invalid_argument_naming_the_field(stack, request_kw, field):
    for call in (stack.stub.GenerateUnary, stack.stub.Generate):
        code, details = _status(call, _req(**request_kw), timeout=60, metadata=AUTH)
        assert code == S.INVALID_ARGUMENT and field in details, (code, details)
        assert len(details) < 400 and "\n" not in details
    assert wait_until(lambda: stack.server.active_sessions() == 0)


def test_the_client_cap_is_counted_before_a_stream_starts(stack):
    long = _req(max_new_tokens=3000, ignore_eos=True)
    held = [stack.stub.Generate(long, timeout=120, metadata=AUTH) for _ in range(2)]
    try:
        for call in held:
            next(call)  # both streaming
        code, details = _status(stack.stub.Generate, long, timeout=60, metadata=AUTH)
        assert code == S.RESOURCE_EXHAUSTED and "limit is 2 per client" in details
    finally:
        for call in held:
            call.cancel()
    assert wait_until(lambda: stack.server.active_sessions() == 0)


def test_a_plugin_whose_open_raises_is_internal_with_a_plain_sentence(stack):
    for call in (stack.stub.GenerateUnary, stack.stub.Generate):
        code, details = _status(call, _req(drafter="open-raises"), timeout=60, metadata=AUTH)
        assert code == S.INTERNAL and "'open-raises' failed to open a session" in details, (code, details)
        assert "/opt" not in details and "class" not in details and "RuntimeError" not in details
    out = stack.stub.GenerateUnary(_req(), timeout=60, metadata=AUTH)
    assert list(out.token_ids) == generate(stack.model, [5, 6, 7], max_new_tokens=4).token_ids
