"""``stree bench isolation``: a victim's latency while hostile clients attack one server (loopback).

Starts ``stree serve`` (a child process, default limits, gRPC and HTTP on 127.0.0.1). For each attack it
measures a victim's short greedy request (from its own source address, 127.0.0.2) alone, then again while
the attack runs from other loopback addresses in a process of its own (killed afterwards, which drops its
connections), and reports the victim's median latency against that baseline, whether every victim answer
was exact (the first baseline's tokens), and how the attack requests were answered. Writes JSON.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

VICTIM = "127.0.0.2"
LONG = 4096


def _http(address: str, local: str):
    import httpx

    return httpx.Client(base_url=f"http://{address}", timeout=600,
                        transport=httpx.HTTPTransport(local_address=local))


class Attack:
    """Runs ``work(i, attack)`` in ``threads`` threads for as long as its process lives; ``record`` counts answers;
    ``ready(counts)`` says when the attack is under way."""

    def __init__(self, name: str, threads: int, work: Callable, ready: Callable[[dict], bool]):
        self.name, self.threads, self.work, self.ready = name, threads, work, ready
        self.outcomes: collections.Counter = collections.Counter()
        self.lock = threading.Lock()

    def record(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.work, args=(i, self), daemon=True) for i in range(self.threads)]
        for t in threads:
            t.start()
        return threads


def _sse_hog(address: str, local: str, body: dict):
    """A worker keeping one long SSE stream open (re-opening it when it ends)."""

    def work(i, attack: Attack):
        with _http(address, local(i)) as http:
            while True:
                try:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        attack.record(f"HTTP {r.status_code}")
                        for _ in r.iter_lines():
                            continue
                except Exception as exc:  # noqa: BLE001 - counted: the server may cut a hostile client off
                    attack.record(type(exc).__name__)
    return work


def _refused_http(address: str, local: str, body: bytes):
    def work(i, attack: Attack):
        while True:
            with _http(address, local(i)) as http:
                try:
                    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                    attack.record(f"HTTP {r.status_code}")
                except Exception as exc:  # noqa: BLE001 - a refused upload may end in a reset connection
                    attack.record(type(exc).__name__)
    return work


def _refused_grpc(address: str, request):
    import grpc

    from stree.proto.stree.v1 import generation_pb2_grpc

    def work(i, attack: Attack):
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            while True:
                try:
                    stub.GenerateUnary(request, timeout=120)
                    attack.record("OK")
                except grpc.RpcError as exc:
                    attack.record(exc.code().name)
    return work


def attacks(grpc_address: str, http_address: str) -> list[Attack]:
    """The probes of issue 40, each from loopback addresses other than the victim's."""
    from stree.proto.stree.v1 import generation_pb2

    long_stream = {"model": "bench", "prompt": "def f(x):", "max_tokens": LONG, "ignore_eos": True,
                   "temperature": 0, "stream": True}
    many_stops = ["s" * 1000] * 10_000
    stop_body = json.dumps({"model": "bench", "prompt": "def f(x):", "max_tokens": 16, "stop": many_stops})
    huge_prompt = json.dumps({"model": "bench", "prompt": "A" * 3_900_000, "max_tokens": 16})
    grpc_stops = generation_pb2.GenerateRequest(prompt_text="def f(x):", max_new_tokens=16, stop=many_stops)

    def admitted(n):
        return lambda outcomes: outcomes["HTTP 200"] >= n

    def answered(outcomes):
        return sum(outcomes.values()) > 0

    return [
        Attack("one client, 16 long SSE streams", 16, _sse_hog(http_address, lambda i: "127.0.0.3", long_stream),
               admitted(16)),
        Attack("4 clients, n=4 x 4096 tokens each", 4,
               _sse_hog(http_address, lambda i: f"127.0.1.{i + 1}", {**long_stream, "n": 4}), admitted(4)),
        Attack("64 source addresses, 10,000 stop strings of 1,000 characters", 64,
               _refused_http(http_address, lambda i: f"127.0.2.{i + 1}", stop_body.encode()), answered),
        Attack("4 gRPC calls, 10,000 stop strings of 1,000 characters", 4, _refused_grpc(grpc_address, grpc_stops),
               answered),
        Attack("a 3.9 M-character prompt, again and again", 1,
               _refused_http(http_address, lambda i: "127.0.3.1", huge_prompt.encode()), answered),
    ]


def victim_runs(http_address: str, prompt: str, tokens: int, repeats: int) -> list[tuple[float, list[int]]]:
    """``repeats`` victim requests, one after another: (seconds, token ids) each."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    out = []
    with _http(http_address, VICTIM) as http:
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json=body)
            seconds = time.perf_counter() - t0
            out.append((seconds, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None))
    return out


class Served:
    """``stree serve MODEL_DIR`` in a child process (default limits), with its gRPC and HTTP addresses."""

    def __init__(self, model_dir: str, drafter: str, device):
        cmd = [sys.executable, "-m", "stree.cli", "serve", model_dir, "--port", "0", "--http-port", "0",
               "--served-model-name", "bench", "--drafter", drafter] + (["--device", device] if device else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if line.startswith("stree serve: gRPC on"):
                words = line.split()
                self.grpc, self.http = words[4], words[9]
                return
        raise RuntimeError(f"stree serve exited with {self.proc.wait()} before it served")

    def live(self) -> float:
        """Requests running plus waiting, from the server's own gauges."""
        import httpx

        text = httpx.get(f"http://{self.http}/metrics", timeout=60).text
        return sum(float(v) for v in re.findall(r'^stree:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$', text,
                                                 flags=re.M))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _attack_process(index: int, grpc_address: str, http_address: str, outcomes, nice: int) -> None:
    """Run attack ``index`` until killed, putting its answer counts on ``outcomes`` every quarter second, at CPU
    priority ``nice`` (on one small machine the attacker's own work, building and uploading bodies, takes the
    server's cores: a positive nice lets it run mostly where the server leaves time, as if it ran elsewhere)."""
    import os

    os.nice(nice)
    attack = attacks(grpc_address, http_address)[index]
    attack.start()
    while True:
        time.sleep(0.25)
        with attack.lock:
            outcomes.put(dict(attack.outcomes))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included), from /proc."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_s(runs) -> float:
    return statistics.median(s for s, _ in runs)


def run(args) -> int:
    served = Served(args.model_dir, args.drafter, args.device)
    ctx = multiprocessing.get_context("spawn")
    rows, want = [], None
    try:
        victim_runs(served.http, args.prompt, args.victim_tokens, 2)  # warm-up
        for index, attack in enumerate(attacks(served.grpc, served.http)):
            if args.probes and index + 1 not in args.probes:
                continue
            base = victim_runs(served.http, args.prompt, args.victim_tokens, args.repeats)
            want = want or base[0][1]
            counts, box = collections.Counter(), ctx.Queue()
            proc = ctx.Process(target=_attack_process, args=(index, served.grpc, served.http, box, args.attacker_nice),
                               daemon=True)
            proc.start()
            server_cpu, attacker_cpu = _cpu_s(served.proc.pid), 0.0
            end = time.monotonic() + 300
            while time.monotonic() < end and not attack.ready(counts):
                try:
                    counts = collections.Counter(box.get(timeout=1.0))
                except queue.Empty:
                    continue
            runs = victim_runs(served.http, args.prompt, args.victim_tokens, args.repeats)
            server_cpu, attacker_cpu = _cpu_s(served.proc.pid) - server_cpu, _cpu_s(proc.pid)
            proc.kill()
            proc.join(60)
            while True:
                try:
                    counts = collections.Counter(box.get(timeout=0.5))
                except queue.Empty:
                    break
            idle_by = time.monotonic() + 300
            while served.live() and time.monotonic() < idle_by:
                time.sleep(0.1)
            baseline, median = _median_s(base), _median_s(runs)
            failed = sum(ids is None for _, ids in base + runs)
            inexact = sum(ids is not None and ids != want for _, ids in base + runs)
            row = {"probe": attack.name, "baseline_ms": 1e3 * baseline, "victim_median_ms": 1e3 * median,
                   "ratio": median / baseline, "victim_requests": len(runs), "victim_failed": failed,
                   "victim_inexact": inexact, "attack_answers": dict(counts), "server_cpu_s": server_cpu,
                   "attacker_cpu_s": attacker_cpu}
            rows.append(row)
            print(f"{attack.name}: victim {1e3 * median:.1f} ms against {1e3 * baseline:.1f} ms alone "
                  f"({median / baseline:.2f}x), {failed} failed, {inexact} inexact; attack answers {dict(counts)}; "
                  f"CPU s: server {server_cpu:.1f}, attacker {attacker_cpu:.1f}", flush=True)
    finally:
        served.close()
    record = {"model_dir": str(args.model_dir), "device": args.device or "default", "drafter": args.drafter,
              "victim_tokens": args.victim_tokens, "repeats": args.repeats,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "probes": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["victim_failed"] == 0 and r["victim_inexact"] == 0 for r in rows) else 1


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("isolation", help="a victim's latency while hostile clients attack one server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve MODEL_DIR on loopback with the default limits and measure a short "
                                   "victim request alone and during each attack of issue 40.")
    p.add_argument("model_dir", nargs="?", default="checkpoints/demo-target", metavar="MODEL_DIR")
    p.add_argument("--drafter", default="ngram", help="the server's drafter (as `stree serve --drafter`)")
    p.add_argument("--prompt", default="def add(a, b):")
    p.add_argument("--victim-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="victim requests per measurement")
    p.add_argument("--attacker-nice", type=int, default=0,
                   help="CPU priority of the attacking process (19: runs where the server leaves time, as if remote)")
    p.add_argument("--probes", type=lambda text: [int(x) for x in text.split(",")], default=None,
                   help="comma-separated probe numbers to run (1-5; default: all)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="results/isolation.json")
    p.set_defaults(func=run)
