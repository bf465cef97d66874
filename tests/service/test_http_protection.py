"""The OpenAI HTTP API under a hostile client (a real server on loopback, raw httpx and sockets).

Bodies are capped in bytes (413) and must arrive in time (408); a prompt past the byte cap is refused
before it is tokenized, and tokenizing an allowed one leaves the server answering others; lone
surrogates and out-of-vocabulary ids are 400s naming the field and the value; a refusal echoes little
of what was sent; the per-client cap is counted before a stream starts and a full queue is a 429
status, never bytes inside a 200 stream; cancelled streams are counted in ``/metrics``; a plugin whose
``open`` raises is a plain 500 before any stream byte; HTTPS uses the gRPC certificate; a server
bound past loopback without a key or TLS says so.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading

import pytest

httpx = pytest.importorskip("httpx")

from service_helpers import TinyStack, wait_until  # noqa: E402
from stree.proto.rpc import exposure_warnings, is_loopback, shared_loop  # noqa: E402
from stree.protocols import HostDrafter  # noqa: E402
from stree.protocols.registry import register_drafter  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits  # noqa: E402
from tls_helpers import self_signed  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
LONG = {"model": "tiny", "prompt": "AB", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


class _OpenRaises(HostDrafter):
    name = "http-open-raises"

    def open(self, prompt_ids, params):
        raise RuntimeError("cannot map /opt/plugins/weights.bin")


register_drafter("http-open-raises", lambda **_: _OpenRaises(), replace=True)


class Watched:
    """The real tokenizer, with ``busy`` set while it encodes (to see what the server does meanwhile)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.busy = tokenizer, threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def _watched(self, method, *args, **kwargs):
        self.busy.set()
        try:
            return method(*args, **kwargs)
        finally:
            self.busy.clear()

    def encode(self, *args, **kwargs):
        return self._watched(self.tokenizer.encode, *args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        return self._watched(self.tokenizer.encode_batch, *args, **kwargs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=41, n_layer=1)
    (s.model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    loop = shared_loop()
    s.watched = Watched(s.tok)
    s.server = GenerationServer(s.model, s.watched, EmbeddedDrafters("host-ngram"), http_port=0, model_name="tiny",
                                model_dir=str(s.model_dir),
                                limits=ServerLimits(max_sessions=2, max_waiting=40, max_seq_len=4096,
                                                    max_streams_per_client=16, body_timeout_s=1.0,
                                                    max_prompt_bytes=700_000))
    s.small = GenerationServer(s.model, s.tok, http_port=0, model_name="tiny",
                               limits=ServerLimits(max_sessions=1, max_waiting=1, max_seq_len=4096))
    loop.run(s.server.start())
    loop.run(s.small.start())
    s.base = f"http://{s.server.http.address}"
    s.http = httpx.Client(timeout=120)
    yield s
    s.http.close()
    loop.run(s.server.stop(0), 30)
    loop.run(s.small.stop(0), 30)


def _post(stack, body, path="/v1/completions", base=None):
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return stack.http.post(f"{base or stack.base}{path}", content=raw, headers={"content-type": "application/json"})


def _idle(server) -> bool:
    return server.active_sessions() == 0 and all(r is None for r in server.core.engine.slots)


def test_lone_surrogates_and_ids_outside_the_vocabulary_name_field_and_value(stack):
    r = _post(stack, '{"model": "tiny", "prompt": "ab\\ud800c", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "surrogate" in r.json()["error"]["message"]
    r = _post(stack, '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
              path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    r = _post(stack, {"model": "tiny", "prompt": [-1, 2], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "prompt[0] = -1" in err["message"], r.text


def test_refusals_echo_little_of_the_input(stack):
    for body in ({"model": "m" * 100_000, "prompt": "A"}, {"model": "tiny", "prompt": "A", "x" * 100_000: 1},
                 {"model": "tiny", "prompt": "A", "drafter": "d" * 100_000}):
        r = _post(stack, body)
        err = r.json()["error"]
        assert r.status_code == 400 and len(err["message"]) < 300 and len(err["param"] or "") < 100, err


def test_bodies_are_capped_in_bytes_and_must_arrive_in_time(stack):
    cap = stack.server.core.max_body_bytes
    r = _post(stack, b"x" * (cap + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the cap holds while reading
        for _ in range(cap // 65536 + 2):
            yield b" " * 65536

    r = stack.http.post(f"{stack.base}/v1/completions", content=chunks())
    assert r.status_code == 413
    host, port = stack.server.http.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # headers, then 10 of 100 bytes
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        answer = sock.recv(4096).decode("latin1")
    assert answer.startswith("HTTP/1.1 408"), answer[:200]


def test_a_prompt_past_the_byte_cap_is_refused_before_tokenizing(stack):
    r = _post(stack, {"model": "tiny", "prompt": "AB" * 1_950_000, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt", r.text
    assert "over the server's limit of 700000 bytes" in err["message"]


def test_tokenizing_a_long_prompt_leaves_the_server_answering(stack):
    done, answered = threading.Event(), []

    def big():  # 600 kB: allowed here, then refused as longer than max_seq_len (after a long tokenization)
        answered.append(_post(stack, {"model": "tiny", "prompt": "AB" * 300_000, "max_tokens": 2}).status_code)
        done.set()

    thread = threading.Thread(target=big)
    thread.start()
    health = 0  # /health answers served from start to end while the prompt was being tokenized
    while not done.is_set():
        before = stack.watched.busy.is_set()
        ok = stack.http.get(f"{stack.base}/health").status_code == 200
        health += ok and before and stack.watched.busy.is_set()
    thread.join()
    assert answered == [400] and health >= 3, health


def test_a_full_queue_is_a_429_status_never_bytes_in_a_stream(stack):
    base = f"http://{stack.small.http.address}"
    with httpx.Client(timeout=60) as http:
        held = [http.stream("POST", f"{base}/v1/completions", json=LONG) for _ in range(2)]  # running + waiting
        responses = [cm.__enter__() for cm in held]
        try:
            assert [r.status_code for r in responses] == [200, 200]
            assert wait_until(lambda: stack.small.active_sessions() == 2)
            r = http.post(f"{base}/v1/completions", json=LONG)
            assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError", r.text[:300]
        finally:
            for cm in held:
                cm.__exit__(None, None, None)
    assert wait_until(lambda: _idle(stack.small))


def test_the_client_cap_is_counted_before_streams_start(stack):
    statuses, opened, release = [], [], threading.Event()
    lock = threading.Lock()

    def one():
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{stack.base}/v1/completions",
                                                            json=LONG) as r:
            with lock:
                statuses.append(r.status_code)
                opened.append(r)
            release.wait(120)

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(statuses) == 40, 120)
    admitted = stack.server.active_sessions()
    release.set()
    for t in threads:
        t.join(120)
    assert sorted(statuses) == [200] * 16 + [429] * 24 and admitted == 16
    assert wait_until(lambda: _idle(stack.server))


def _abort_count(stack) -> float:
    text = stack.http.get(f"{stack.base}/metrics").text
    m = re.search(r'stree:request_success_total\{finished_reason="abort",model_name="tiny"\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_cancelled_streams_are_counted_in_metrics(stack):
    before = _abort_count(stack)
    with httpx.Client(timeout=60) as http:
        for _ in range(5):
            with http.stream("POST", f"{stack.base}/v1/completions", json=LONG) as r:
                next(r.iter_lines())
    assert wait_until(lambda: _idle(stack.server))
    assert wait_until(lambda: _abort_count(stack) == before + 5), (_abort_count(stack), before)


def test_a_plugin_whose_open_raises_is_a_plain_500_before_any_stream_byte(stack):
    for stream in (False, True):
        r = _post(stack, {"model": "tiny", "prompt": "AB", "max_tokens": 3, "drafter": "http-open-raises",
                          "stream": stream})
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text[:300]
        message = r.json()["error"]["message"]
        assert "'http-open-raises' failed to open a session" in message and "/opt" not in message
    ok = _post(stack, {"model": "tiny", "prompt": [3, 4], "max_tokens": 3, "temperature": 0}).json()
    assert ok["choices"][0]["token_ids"] == generate(stack.model, [3, 4], max_new_tokens=3).token_ids


def test_https_with_the_grpc_certificate(tmp_path):
    s = TinyStack(tmp_path, seed=42, n_layer=1)
    cert, key = self_signed(tmp_path, "localhost")
    server = GenerationServer(s.model, s.tok, http_port=0, model_name="tiny", tls=(cert.read_bytes(),
                              key.read_bytes()), limits=ServerLimits(max_sessions=1, max_seq_len=128))
    shared_loop().run(server.start())
    try:
        url = f"https://127.0.0.1:{server.http.port}/v1/completions"
        body = {"model": "tiny", "prompt": [3, 4], "max_tokens": 3, "temperature": 0}
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as http:
            out = http.post(url, json=body).json()
        assert out["choices"][0]["token_ids"] == generate(s.model, [3, 4], max_new_tokens=3).token_ids
        with pytest.raises(httpx.HTTPError):
            httpx.post(url.replace("https", "http"), json=body, timeout=10)
    finally:
        shared_loop().run(server.stop(0), 30)


def test_a_bind_past_loopback_without_key_or_tls_is_warned_about():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.org")
    assert exposure_warnings("127.0.0.1", False, False) == []
    warnings = exposure_warnings("0.0.0.0", False, False)
    assert len(warnings) == 2 and "API key" in warnings[0] and "TLS" in warnings[1]
    assert exposure_warnings("0.0.0.0", True, True) == []
