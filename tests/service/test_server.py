"""End to end: stree.Client -> GenerationService -> DrafterService -> Ray actors, on loopback.

Greedy output must equal plain greedy decoding and in-process speculative decoding. The ``chain``
drafter is given the target checkpoint as its draft model, so it proposes the target's own greedy
continuation (an oracle) and drafts really get accepted; ``ngram`` exercises a model-free drafter.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import pytest

ray = pytest.importorskip("ray")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (  # noqa: E402
    ProtoReflectionDescriptorDatabase,
)

import stree  # noqa: E402
from stree.cli import main as stree_main  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from service_helpers import drafter_service, wait_until  # noqa: E402
from stree.proto.stree.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from stree.protocols import DraftBudget  # noqa: E402
from stree.verifier.model.checkpoint import init_model, load_model  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.server import (  # noqa: E402
    EmbeddedDrafters,
    GenerationServer,
    RemoteDrafters,
    ServerLimits,
)
from stree.verifier.model.tokenizer import load_tokenizer  # noqa: E402

BUDGET = DraftBudget(max_nodes=8, max_depth=4, max_width=2)
PROMPTS = [[5, 9, 13, 2, 7], [1, 2, 3, 4, 1, 2, 3, 4], [40], [33, 12, 60, 7, 7, 7, 21]]
N_NEW = 24
MAX_SEQ = 4096


class Stack:
    """The model, its plain greedy outputs and the running servers."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack()
    s.model_dir = init_model(tmp_path_factory.mktemp("m") / "tiny", arch="mamba2", d_model=32, n_layer=2,
                             vocab_size=64, seed=3)
    s.model = load_model(s.model_dir)
    s.tokenizer = load_tokenizer(s.model_dir)
    s.plain = [generate(s.model, p, drafter=None, max_new_tokens=N_NEW).token_ids for p in PROMPTS]
    loop = shared_loop()
    service = drafter_service(["chain", "ngram"], replicas=1,
                              options_for=lambda name: {"draft_model": str(s.model_dir)} if name == "chain" else {})
    s.drafters = service.__enter__()
    limits = ServerLimits(max_sessions=6, max_seq_len=MAX_SEQ, budget=BUDGET)
    s.remote = GenerationServer(
        s.model, s.tokenizer, RemoteDrafters(f"grpc://{s.drafters.address}/chain", 2.0, BUDGET),
        limits=limits, metrics_port=0, model_name="tiny",
    )
    s.embedded = GenerationServer(
        s.model, s.tokenizer, EmbeddedDrafters("chain", draft_model=s.model),
        limits=ServerLimits(max_sessions=2, max_waiting=0, max_seq_len=MAX_SEQ, budget=BUDGET),
    )
    loop.run(s.remote.start())
    loop.run(s.embedded.start())
    s.client = stree.Client(s.remote.address, timeout=120)
    yield s
    s.client.close()
    loop.run(s.remote.stop(0), 30)
    loop.run(s.embedded.stop(0), 30)
    service.__exit__(None, None, None)


def test_remote_greedy_equals_plain_and_in_process(stack):
    accepted = 0
    for prompt, plain in zip(PROMPTS, stack.plain):
        in_process = generate(stack.model, prompt, drafter="chain", draft_model=stack.model,
                              max_new_tokens=N_NEW, budget=BUDGET)
        assert in_process.token_ids == plain
        out = stack.client.generate(prompt_ids=prompt, max_new_tokens=N_NEW)
        assert out.token_ids == plain
        assert out.finish_reason == "length" and out.stats["generated_tokens"] == N_NEW
        assert out.stats["drafter"] == "chain"
        accepted += out.stats["accepted_draft_tokens"]
        ngram = stack.client.generate(prompt_ids=prompt, max_new_tokens=N_NEW, drafter="ngram")
        assert ngram.token_ids == plain and ngram.stats["drafter"] == "ngram"
        none = stack.client.generate(prompt_ids=prompt, max_new_tokens=N_NEW, drafter="none")
        assert none.token_ids == plain and none.stats["steps"] == N_NEW
    # The oracle drafter's chains are the target's own greedy tokens: most of them are accepted.
    assert accepted > N_NEW * len(PROMPTS) // 2


def test_embedded_server_matches_too(stack):
    with stree.Client(stack.embedded.address) as client:
        for prompt, plain in zip(PROMPTS, stack.plain):
            out = client.generate(prompt_ids=prompt, max_new_tokens=N_NEW)
            assert out.token_ids == plain
            assert out.stats["accepted_draft_tokens"] > 0


def test_streaming_chunks_add_up(stack):
    chunks = list(stack.client.stream(prompt_ids=PROMPTS[0], max_new_tokens=N_NEW))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == stack.plain[0]
    assert all(not c.finished for c in chunks[:-1]) and chunks[-1].finished
    assert chunks[-1].finish_reason == "length" and chunks[-1].stats["generated_tokens"] == N_NEW
    steps = [c.step for c in chunks[:-1]]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(s["draft_nodes"] >= 1 for s in steps)
    assert "".join(c.text for c in chunks) == stack.tokenizer.decode(ids)


def test_concurrent_sessions_do_not_mix(stack):
    results, errors = {}, []

    def run(k):
        try:
            with stree.Client(stack.remote.address, timeout=120) as client:
                for rep in range(2):
                    results[(k, rep)] = client.generate(prompt_ids=PROMPTS[k], max_new_tokens=N_NEW).token_ids
        except Exception as exc:  # reported by the assert below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    for (k, _), ids in results.items():
        assert ids == stack.plain[k]


def test_text_prompt_and_stop_conditions(stack):
    text_prompt = "HELLO WORLD"
    ids = stack.tokenizer.encode(text_prompt).ids
    plain = generate(stack.model, ids, drafter=None, max_new_tokens=N_NEW).token_ids
    out = stack.client.generate(text_prompt, max_new_tokens=N_NEW)
    assert out.token_ids == plain and out.text == stack.tokenizer.decode(plain)
    # A stop token: output ends right after its first occurrence.
    stop_tok = plain[6]
    out = stack.client.generate(text_prompt, max_new_tokens=N_NEW, stop_token_ids=[stop_tok])
    assert out.token_ids == plain[: plain.index(stop_tok) + 1] and out.finish_reason == "stop"
    # A stop string: text ends before it; tokens end with the one that completed it.
    full = stack.tokenizer.decode(plain)
    stop = full[8:10]
    cut = full.index(stop)
    for streaming in (False, True):
        if streaming:
            chunks = list(stack.client.stream(text_prompt, max_new_tokens=N_NEW, stop=[stop]))
            text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
            toks = [t for c in chunks for t in c.token_ids]
        else:
            res = stack.client.generate(text_prompt, max_new_tokens=N_NEW, stop=[stop])
            text, reason, toks = res.text, res.finish_reason, res.token_ids
        assert text == full[:cut] and reason == "stop"
        assert stop in stack.tokenizer.decode(toks) and stop not in stack.tokenizer.decode(toks[:-1])


def _req(**kw):
    prompt_ids = kw.pop("prompt_ids", [1, 2, 3])
    req = generation_pb2.GenerateRequest(max_new_tokens=kw.pop("max_new_tokens", 4), **kw)
    if prompt_ids is not None:
        req.prompt_ids.ids.extend(prompt_ids)
    return req


@pytest.mark.parametrize(
    "request_, needle",
    [
        (_req(drafter="no-such-drafter"), "unknown drafter 'no-such-drafter'"),
        (_req(sampling=common_pb2.SamplingParams(temperature=-1.0)), "sampling.temperature must be 0 (greedy) or in"),
        (_req(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0)), "sampling.top_p must be in"),
        (_req(prompt_ids=None), "no prompt"),
        (_req(prompt_ids=[]), "prompt is empty"),
        (_req(prompt_ids=None, prompt_text=""), "prompt is empty"),
        (_req(prompt_ids=[1] * (MAX_SEQ - 3), max_new_tokens=10), f"limit of {MAX_SEQ} tokens"),
        (_req(prompt_ids=[1, 64]), "prompt_ids[1] = 64 is outside the vocabulary"),
        (_req(budget=common_pb2.DraftBudget(max_nodes=5000)), "bad draft budget"),
        (_req(max_new_tokens=100000), "over the server's limit"),
    ],
)
def test_bad_requests_are_invalid_argument(stack, request_, needle):
    with grpc.insecure_channel(stack.remote.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for call in (stub.GenerateUnary, lambda r, **kw: list(stub.Generate(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(request_, timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details()


def test_client_raises_value_error_on_bad_requests(stack):
    with pytest.raises(ValueError, match="temperature"):
        stack.client.generate(prompt_ids=[1, 2], temperature=-2.0)
    with pytest.raises(ValueError, match="exactly one of"):
        stack.client.generate(prompt="A", prompt_ids=[1])


def test_cancel_frees_the_session_here_and_in_the_drafter_service(stack):
    assert wait_until(lambda: stack.remote.active_sessions() == 0)
    stream = stack.client.stream(prompt_ids=PROMPTS[1], max_new_tokens=MAX_SEQ - 16, drafter="ngram")
    first = next(stream)
    assert first.token_ids
    assert stack.remote.active_sessions() == 1
    assert wait_until(lambda: stack.drafters.active_sessions() == 1)
    stream.close()  # cancels the call
    assert wait_until(lambda: stack.remote.active_sessions() == 0)
    assert wait_until(lambda: stack.drafters.active_sessions() == 0)
    assert wait_until(lambda: stack.drafters.host.num_sessions() == 0)


def test_session_limit_is_resource_exhausted(stack):
    with stree.Client(stack.embedded.address) as client:
        streams = [client.stream(prompt_ids=[1, 2], max_new_tokens=MAX_SEQ - 16, drafter="none") for _ in range(2)]
        for s in streams:
            next(s)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_ids=[1, 2], max_new_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in streams:
            s.close()
    assert wait_until(lambda: stack.embedded.active_sessions() == 0)


def test_health_reflection_and_metrics(stack):
    assert stack.client.health() == "SERVING"
    assert stack.client.health("stree.v1.GenerationService") == "SERVING"
    with grpc.insecure_channel(stack.remote.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert {"stree.v1.GenerationService", "grpc.health.v1.Health"} <= set(db.get_services())
        assert db.FindFileContainingSymbol("stree.v1.GenerateRequest").name == "stree/v1/generation.proto"
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    stack.client.generate(prompt_ids=PROMPTS[0], max_new_tokens=N_NEW)
    body = urllib.request.urlopen(f"http://{stack.remote.metrics_address}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line.startswith("stree:") and "{" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    for name in ("stree:spec_decode_num_accepted_tokens_total", "stree:spec_decode_num_draft_tokens_total",
                 "stree:generation_tokens_total", "stree:time_to_first_token_seconds_count",
                 "stree:request_success_total"):
        assert values.get(name, 0) > 0, name
    assert "stree:drafter_fallbacks_total" in values and "stree:num_requests_running" in values


def test_cli_client_generate(stack, capsys):
    addr = stack.remote.address
    ids = ",".join(map(str, PROMPTS[0]))
    assert stree_main(["client", "generate", "--server", addr, "--prompt-ids", ids,
                       "--max-new-tokens", str(N_NEW), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == stack.plain[0] and out["stats"]["generated_tokens"] == N_NEW
    assert stree_main(["client", "generate", "--server", addr, "--prompt-ids", ids,
                       "--max-new-tokens", str(N_NEW), "--stream", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t for line in lines for t in line["token_ids"]] == stack.plain[0] and lines[-1]["finished"]
    assert stree_main(["client", "generate", "--server", addr, "--prompt-ids", ids, "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_model_drafter_replicas_use_cpu_without_gpus(stack):
    pool = stack.drafters.host.pools["chain"]
    assert pool.spec.uses_model and pool.num_gpus == 0
    info = ray.get(pool.replicas[0].handle.info.remote())
    assert info["device"] == "cpu" and info["name"] == "chain"
