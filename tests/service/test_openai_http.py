"""The OpenAI-compatible HTTP API on loopback, driven by the official ``openai`` client and raw httpx.

Greedy output over HTTP (completions and chat, streamed and not) equals ``stree.generate``; bad
bodies get 400s in OpenAI's error shape; a full queue gets 429 and the server keeps serving;
a client that disconnects frees its slot.
"""

from __future__ import annotations

import json
import threading

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from service_helpers import TinyStack, wait_until  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.chat_template import ChatTemplate  # noqa: E402
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] | upper }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<ASSISTANT>{% endif %}")
N_NEW = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=4)
    (s.model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "^", "eos_token": {"content": "~"}}))
    loop = shared_loop()
    s.server = GenerationServer(s.model, s.tok, EmbeddedDrafters("ngram"), http_port=0, model_name="tiny",
                                model_dir=str(s.model_dir),
                                limits=ServerLimits(max_sessions=8, max_waiting=96, max_seq_len=512,
                                                    max_streams_per_client=128, max_num_samples=3))
    s.small = GenerationServer(s.model, s.tok, http_port=0, model_name="tiny", api_key="sekrit",
                               limits=ServerLimits(max_sessions=1, max_waiting=1, max_seq_len=4096))
    loop.run(s.server.start())
    loop.run(s.small.start())
    s.url = f"http://{s.server.http.address}/v1"
    s.client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
    yield s
    loop.run(s.server.stop(0), 30)
    loop.run(s.small.stop(0), 30)


def _greedy(stack, text, n=N_NEW):
    return generate(stack.model, stack.tok.encode(text).ids, drafter=None, max_new_tokens=n).token_ids


def test_completions_match_generate_streamed_and_not(stack):
    want = _greedy(stack, "HELLO WORLD")
    out = stack.client.completions.create(model="tiny", prompt="HELLO WORLD", max_tokens=N_NEW, temperature=0)
    assert out.choices[0].text == stack.tok.decode(want) and out.choices[0].finish_reason == "length"
    assert out.choices[0].token_ids == want
    assert out.usage.completion_tokens == N_NEW and "speculative" in out.usage.model_extra
    chunks = list(stack.client.completions.create(model="tiny", prompt="HELLO WORLD", max_tokens=N_NEW,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == stack.tok.decode(want)
    assert chunks[-1].usage.completion_tokens == N_NEW and not chunks[-1].choices


def test_chat_uses_the_template_streamed_and_not(stack):
    messages = [{"role": "system", "content": "BE BRIEF"}, {"role": "user", "content": "HI"}]
    prompt = ChatTemplate.from_model_dir(str(stack.model_dir)).render(messages)
    assert prompt == "^<SYSTEM>BE BRIEF<USER>HI<ASSISTANT>"
    want = stack.tok.decode(_greedy(stack, prompt))
    out = stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=N_NEW, temperature=0)
    assert out.choices[0].message.content == want and out.choices[0].message.role == "assistant"
    chunks = list(stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=N_NEW,
                                                       temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


def test_models_health_metrics_and_n(stack):
    assert [m.id for m in stack.client.models.list().data] == ["tiny"]
    base = stack.url[: -len("/v1")]
    assert httpx.get(f"{base}/health").status_code == 200
    out = stack.client.completions.create(model="tiny", prompt="AB", max_tokens=4, temperature=0, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) == 1
    body = httpx.get(f"{base}/metrics").text
    for name in ("stree:num_requests_running", "stree:num_requests_waiting", "stree:time_to_first_token_seconds",
                 "stree:inter_token_latency_seconds", "stree:e2e_request_latency_seconds",
                 "stree:spec_decode_num_draft_tokens_total"):
        assert name in body, name


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ({"model": "nope", "prompt": "A"}, "model"),
    ({"model": "tiny", "prompt": "A", "max_tokens": -1}, "max_tokens"),
    ({"model": "tiny", "prompt": "A", "n": 50}, "n"),
    ({"model": "tiny", "prompt": "A", "stop": 7}, "stop"),
    ({"model": "tiny", "prompt": "A", "stop": [""]}, "stop"),
    ({"model": "tiny", "prompt": "A", "frobnicate": 1}, "frobnicate"),
    ({"model": "tiny", "prompt": "A", "logprobs": 2}, "logprobs"),
    ({"model": "tiny", "prompt": "A", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "A", "max_tokens": 10**6}, "max_tokens"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
])
def test_bad_bodies_get_openai_400s(stack, body, param):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{stack.url}/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(model="tiny", messages=[], max_tokens=2)


def test_api_key_queue_bound_and_disconnect(stack):
    small = stack.small
    url = f"http://{small.http.address}/v1"
    assert httpx.get(f"{url}/models").status_code == 401
    auth = {"authorization": "Bearer sekrit"}
    body = {"model": "tiny", "prompt": "AB", "max_tokens": 4000, "temperature": 0, "stream": True}
    streams = []
    with httpx.Client(timeout=60) as http:
        for _ in range(2):  # one running, one waiting: the bound
            cm = http.stream("POST", f"{url}/completions", json=body, headers=auth)
            streams.append((cm, cm.__enter__()))
        lines = streams[0][1].iter_lines()  # held: dropping the iterator closes the response
        next(lines)
        assert wait_until(lambda: small.active_sessions() == 2)
        r = http.post(f"{url}/completions", json={**body, "stream": False}, headers=auth)
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
        for cm, _ in streams:  # client disconnects
            cm.__exit__(None, None, None)
    assert wait_until(lambda: small.active_sessions() == 0)
    assert all(slot is None for slot in small.core.engine.slots)
    ok = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0).completions.create(
        model="tiny", prompt="AB", max_tokens=3, temperature=0)
    assert ok.choices[0].token_ids == _greedy(stack, "AB", 3)


def test_64_concurrent_streams_equal_their_solo_runs(stack):
    prompts = [f"Q{i:02d} {chr(65 + i % 26)}" for i in range(64)]
    want = {p: stack.tok.decode(_greedy(stack, p, 6)) for p in prompts}
    got, errors = {}, []

    def run(p):
        try:
            chunks = stack.client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                                     stream=True)
            got[p] = "".join(c.choices[0].text for c in chunks if c.choices)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and got == want
    assert wait_until(lambda: stack.server.active_sessions() == 0)


def test_sampled_rows_beside_greedy_rows_leave_greedy_exact(stack):
    want = stack.tok.decode(_greedy(stack, "GREEDY", 8))
    got, errors = {}, []

    def run(k):
        try:
            temp = 0 if k == 0 else 1.0
            out = stack.client.completions.create(model="tiny", prompt="GREEDY" if k == 0 else f"HOT {k}",
                                                  max_tokens=8, temperature=temp, top_p=0.9,
                                                  extra_body={"top_k": 20})
            got[k] = out.choices[0].text
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [] and got[0] == want and len(got) == 5


def test_a_seeded_sampled_request_is_the_same_alone_or_among_others(stack):
    """At T > 0 a request's draws are keyed by its seed and its own steps: sent alone, then again while eight others
    of other seeds run beside it, it returns the same tokens (a server whose n-gram drafter has one fixed tree; one
    that picks trees by goodput picks by batch). Choice i of ``n`` with seed s is the request of seed s + i; another
    seed gives other tokens."""
    fixed = EmbeddedDrafters("ngram", options={"lookup_tree": "lookup:trie:4x3"})
    server = GenerationServer(stack.model, stack.tok, fixed, http_port=0, model_name="tiny",
                              limits=ServerLimits(max_sessions=16, max_waiting=16, max_seq_len=512,
                                                  max_streams_per_client=16, max_num_samples=3))
    shared_loop().run(server.start())
    try:
        client = openai.OpenAI(base_url=f"http://{server.http.address}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        ask = dict(model="tiny", max_tokens=N_NEW, temperature=1.5, top_p=0.97)
        alone = client.completions.create(prompt="ABCABCAB", seed=77, **ask).choices[0].token_ids
        results: dict = {}

        def send(i: int) -> None:
            prompt, seed = ("ABCABCAB", 77) if i == 4 else (f"XY{i}Z" * (i + 1), 1000 + i)
            results[i] = client.completions.create(prompt=prompt, seed=seed, **ask).choices[0].token_ids

        threads = [threading.Thread(target=send, args=(i,)) for i in range(9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results[4] == alone
        choices = client.completions.create(prompt="ABCABCAB", seed=76, n=3, **ask).choices
        assert [c.token_ids for c in sorted(choices, key=lambda c: c.index)][1] == alone
        assert client.completions.create(prompt="ABCABCAB", seed=78, **ask).choices[0].token_ids != alone
    finally:
        shared_loop().run(server.stop(0), 30)
