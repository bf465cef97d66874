"""Hypothesis fuzzing of the verifier's GenerationService on a real loopback server (random field values and
random bytes, unary and streamed): only documented statuses come back, messages carry no internals, and a good
request still gets the exact greedy output of ``stree.generate`` after."""

from __future__ import annotations

import re

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stree
from service_helpers import wait_until
from stree.proto.rpc import shared_loop
from stree.proto.stree.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from stree.protocols import DraftBudget
from stree.verifier.model.tokenizer import load_tokenizer
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits

S = grpc.StatusCode
# What a call may end with: OK, or a refusal naming the field and the limit (CANCELLED: the client went away).
DOCUMENTED = {S.OK, S.INVALID_ARGUMENT, S.OUT_OF_RANGE, S.RESOURCE_EXHAUSTED, S.FAILED_PRECONDITION, S.CANCELLED}
LEAKS = ("Traceback", "Error(", ".py", "pid=", "0x", "ray::", "<class", "File \"", "site-packages")
# Python class names (the wire's own message names, such as stree.v1.GenerateRequest, are documented, not internals)
CLASS_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|\b(QueueFull|InvalidRequest|BadField|ServingCore)\b")
PATH = re.compile(r"(/[\w.-]+){2,}")
# Small bounds keep every accepted request a few CPU steps; past them requests must be refused, not run.
LIMITS = ServerLimits(max_sessions=4, max_waiting=16, max_seq_len=64, default_max_new_tokens=2, max_new_tokens=8,
                      max_prompt_chars=256, budget=DraftBudget(max_nodes=8, max_depth=4, max_width=2))
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
RUNS = settings(FUZZ, max_examples=30)  # examples that may generate: a few CPU steps each
GENERATE = "/stree.v1.GenerationService/Generate"
UNARY = "/stree.v1.GenerationService/GenerateUnary"


@pytest.fixture(scope="module")
def server(models, model_dirs):
    srv = GenerationServer(models["mamba2"], load_tokenizer(model_dirs["mamba2"]), EmbeddedDrafters("ngram"),
                           limits=LIMITS, model_name="tiny")
    shared_loop().run(srv.start())
    yield srv
    shared_loop().run(srv.stop(0), 30)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _call(channel, payload, streamed: bool, raw: bool):
    """One call; (final status, details). ``raw``: ``payload`` is bytes sent as they are."""
    ser = None if raw else generation_pb2.GenerateRequest.SerializeToString
    try:
        if streamed:
            call = channel.unary_stream(GENERATE, request_serializer=ser,
                                        response_deserializer=generation_pb2.GenerateChunk.FromString)
            chunks = list(call(payload, timeout=120))
            assert chunks and chunks[-1].finished and all(not c.finished for c in chunks[:-1])
        else:
            call = channel.unary_unary(UNARY, request_serializer=ser,
                                       response_deserializer=generation_pb2.GenerateResponse.FromString)
            call(payload, timeout=120)
        return S.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def _check(code, details, echoed=()):
    """Documented status; no internals in the message once the client's own strings (quoted) are taken out."""
    assert code in DOCUMENTED, (code, details)
    text = details
    for s in echoed:
        text = text.replace(repr(s), "''")
    assert not any(leak in text for leak in LEAKS), details
    assert not CLASS_NAME.search(text), details
    assert not PATH.search(text), details


u32 = st.integers(0, 2**32 - 1)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-3, 0.5, 1.0, 2.0, -1.0, float("nan"), float("inf")]))
vocab_ids = st.integers(0, 63)
wild_ids = st.one_of(st.integers(64, 70), u32)
letters = "ABCDEFGHIJ KLMNOP"
# A request is a good one with 0 to 3 of its fields made wild, so that requests both get refused and run (stop
# strings and ids, drafters, sampled rows, budgets): each field's (good, wild) values.
FIELDS = {
    "max_new_tokens": (st.integers(0, 3), u32),
    "stop_token_ids": (st.lists(vocab_ids, max_size=3), st.lists(st.one_of(vocab_ids, wild_ids), max_size=6)),
    "stop": (st.lists(st.text(letters, min_size=1, max_size=3), max_size=3), st.lists(st.text(max_size=40), max_size=4)),
    "drafter": (st.sampled_from(["", "none", "ngram", "static-tree"]),
                st.one_of(st.sampled_from(["chain", "mamba", "retrieval", "fusion", "fusion:ngram+ngram",
                                           "fusion:ngram", "fusion:", "treeflash", "nope", "ngram\x00", "../ngram",
                                           "NGRAM", " ngram"]), st.text(max_size=20))),
    "request_id": (st.text(letters, max_size=8), st.text(max_size=40)),
    "sampling": (st.one_of(st.none(), st.builds(
                     common_pb2.SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                     top_k=st.integers(0, 70), top_p=st.one_of(st.none(), st.floats(1e-3, 1.0)),
                     seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))),
                 st.builds(common_pb2.SamplingParams, temperature=floats, top_k=u32,
                           top_p=st.one_of(st.none(), floats), seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)))),
    "budget": (st.one_of(st.none(), st.builds(common_pb2.DraftBudget, max_nodes=st.integers(0, 8),
                                              max_depth=st.integers(0, 4), max_width=st.integers(0, 2))),
               st.builds(common_pb2.DraftBudget, max_nodes=u32, max_depth=u32, max_width=u32)),
    "prompt_ids": (st.lists(vocab_ids, min_size=1, max_size=20),
                   st.one_of(st.lists(st.one_of(vocab_ids, wild_ids), max_size=80),
                             st.sampled_from([300_000, 2_000, 65]).map(lambda n: [7] * n))),  # past size/length caps
    "prompt_text": (st.text(letters, min_size=1, max_size=20),
                    st.one_of(st.text(max_size=40), st.sampled_from(["", "A" * 300, "\x00", "\ud7ff\ue000"]))),
}


@st.composite
def requests(draw):
    wild = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(sorted(FIELDS)), max_size=3)))
    value = {name: draw(pair[name in wild]) for name, pair in FIELDS.items()}
    req = generation_pb2.GenerateRequest(max_new_tokens=value["max_new_tokens"], stop=value["stop"],
                                         stop_token_ids=value["stop_token_ids"], drafter=value["drafter"],
                                         request_id=value["request_id"], ignore_eos=draw(st.booleans()))
    for name in ("sampling", "budget"):
        if value[name] is not None:
            getattr(req, name).CopyFrom(value[name])
    prompt = draw(st.sampled_from(["prompt_ids", "prompt_text", "none"] if wild else ["prompt_ids", "prompt_text"]))
    if prompt == "prompt_ids":
        req.prompt_ids.ids.extend(value["prompt_ids"])
    elif prompt == "prompt_text":
        req.prompt_text = value["prompt_text"]
    return req


@RUNS
@given(req=requests(), streamed=st.booleans())
def test_random_field_values_get_documented_answers(channel, req, streamed):
    code, details = _call(channel, req, streamed, raw=False)
    _check(code, details, echoed=[req.drafter, req.request_id, *req.stop])


@FUZZ
@given(payload=st.one_of(st.binary(max_size=96), requests().map(lambda r: r.SerializeToString()[:-1])),
       streamed=st.booleans())
def test_random_bytes_get_documented_answers(channel, payload, streamed):
    _check(*_call(channel, payload, streamed, raw=True))


@pytest.mark.parametrize("payload", [b"\x0a\x05\xff\xfe\xfd\xfc\xfb", b"\x12\x05\x08", b"\x07", b"\xff" * 8])
def test_malformed_protobuf_is_invalid_argument(channel, payload):
    """Invalid UTF-8 in prompt_text, a truncated field, a bad wire type, a bad tag: ours to refuse."""
    for streamed in (False, True):
        code, details = _call(channel, payload, streamed, raw=True)
        assert code == S.INVALID_ARGUMENT and "GenerateRequest" in details, (code, details)


def test_a_good_request_gets_the_greedy_output_after_the_fuzzing(channel, server, models):
    prompt = [5, 9, 13, 2, 7]
    want = stree.generate(models["mamba2"], prompt, max_new_tokens=8).token_ids
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=prompt), max_new_tokens=8,
                                         ignore_eos=True)
    out = stub.GenerateUnary(req, timeout=120)
    assert list(out.token_ids) == want and out.finish_reason == "length"
    streamed = [t for c in stub.Generate(req, timeout=120) for t in c.token_ids]
    assert streamed == want
    assert wait_until(lambda: server.active_sessions() == 0)
