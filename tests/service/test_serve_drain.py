"""``stree serve`` drains on SIGTERM (a real server process on loopback).

With 8 streams in flight (6 SSE, 2 gRPC), SIGTERM makes the server report draining (HTTP ``/health`` 503,
gRPC health NOT_SERVING), refuse new requests (HTTP 503, gRPC UNAVAILABLE, each with a sentence saying
why), finish every stream exact, and exit 0. Streams that cannot finish within ``--drain-timeout`` end
with an error event and ``[DONE]`` (SSE) or UNAVAILABLE (gRPC), never a cut connection.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import grpc
import pytest

httpx = pytest.importorskip("httpx")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from service_helpers import TinyStack  # noqa: E402
from stree.proto.stree.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402

PROMPTS = [[(3 * i + k) % 60 + 1 for k in range(2 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return TinyStack(tmp_path_factory.mktemp("m"), seed=51, n_layer=1)


class Served:
    """``stree serve`` in a child process, with its gRPC and HTTP addresses."""

    def __init__(self, model_dir, tmp_path, *flags):
        self.log = open(tmp_path / "serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stree.cli", "serve", str(model_dir), "--port", "0", "--http-port", "0",
             "--drafter", "none", "--max-sessions", "8", "--max-seq-len", "4096", *flags],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        for line in self.proc.stdout:
            if line.startswith("stree serve: gRPC on"):
                words = line.split()
                self.grpc, self.http = words[4], words[9]
                break
        else:
            raise AssertionError(f"stree serve did not start: {(tmp_path / 'serve.log').read_text()[-2000:]}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.log.close()


def _sse(http_addr, prompt, max_tokens, first: threading.Event, out: dict, key):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    tokens, events = [], []
    with httpx.Client(timeout=300) as http, http.stream("POST", f"http://{http_addr}/v1/completions",
                                                        json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line != "data: [DONE]":
                msg = json.loads(line[6:])
                tokens += msg["choices"][0]["token_ids"] if "choices" in msg else []
            first.set()
    out[key] = (tokens, events)


def _grpc(addr, prompt, max_new, first: threading.Event, out: dict, key):
    tokens, last = [], None
    with grpc.insecure_channel(addr) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        req = generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=prompt), max_new_tokens=max_new,
                                             ignore_eos=True)
        try:
            for chunk in stub.Generate(req, timeout=300):
                tokens += chunk.token_ids
                last = chunk
                first.set()
            out[key] = (tokens, grpc.StatusCode.OK, last.finish_reason)
        except grpc.RpcError as exc:
            out[key] = (tokens, exc.code(), exc.details())


def _start_streams(served, max_tokens, n_sse, n_grpc) -> tuple[dict, list]:
    out, threads, firsts = {}, [], []
    for i in range(n_sse + n_grpc):
        first = threading.Event()
        fn, addr = (_sse, served.http) if i < n_sse else (_grpc, served.grpc)
        threads.append(threading.Thread(target=fn, args=(addr, PROMPTS[i], max_tokens, first, out, i)))
        firsts.append(first)
        threads[-1].start()
    for first in firsts:
        assert first.wait(120), "a stream never started"
    return out, threads


def test_sigterm_with_8_streams_in_flight_finishes_them_and_refuses_newcomers(tiny, tmp_path):
    n_new = 2000
    want = [o.token_ids for o in generate(tiny.model, PROMPTS, max_new_tokens=n_new)]
    served = Served(tiny.model_dir, tmp_path, "--drain-timeout", "120")
    try:
        out, threads = _start_streams(served, n_new, 6, 2)
        served.proc.send_signal(signal.SIGTERM)
        with httpx.Client(timeout=60) as http:
            assert http.get(f"http://{served.http}/health").status_code == 503
            r = http.post(f"http://{served.http}/v1/completions",
                          json={"model": "tiny", "prompt": [5], "max_tokens": 2})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        with grpc.insecure_channel(served.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GenerateUnary(generation_pb2.GenerateRequest(prompt_ids=generation_pb2.TokenIds(ids=[5])),
                                   timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        for t in threads:
            t.join(300)
        assert served.proc.wait(120) == 0
        for i in range(6):
            tokens, events = out[i]
            assert events[-1] == "[DONE]" and tokens == want[i], (i, events[-3:])
        for i in (6, 7):
            assert out[i] == (want[i], grpc.StatusCode.OK, "length"), (i, out[i][1:])
    finally:
        served.close()


def test_streams_past_the_drain_timeout_end_with_an_error_event(tiny, tmp_path):
    served = Served(tiny.model_dir, tmp_path, "--drain-timeout", "0.5")
    try:
        out, threads = _start_streams(served, 4000, 2, 1)
        served.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(300)
        assert served.proc.wait(120) == 0
        for i in range(2):
            tokens, events = out[i]
            assert events[-1] == "[DONE]" and 0 < len(tokens) < 4000, (i, events[-3:])
            err = json.loads(events[-2])["error"]
            assert err["code"] == 503 and "shut down before this request finished" in err["message"]
        tokens, code, details = out[2]
        assert code == grpc.StatusCode.UNAVAILABLE and "shut down before this request finished" in details
        assert 0 < len(tokens) < 4000
    finally:
        served.close()
