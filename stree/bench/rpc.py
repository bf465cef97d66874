"""``stree bench rpc``: what the remote drafter path costs per step, against the same drafter in-process.

Starts ``stree drafter-service`` as a separate process on loopback (its own local Ray), then runs
the same n-gram session in-process and through ``RemoteDrafter`` (pipelined and not, with and
without simulated verifier work between commit and the next draft), and full decoding steps of a
tiny random model with each. Reports p50/p99 per step as a table and a JSON record.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Optional

import torch

from stree.protocols.drafter import DraftBudget
from stree.protocols.registry import create_drafter
from stree.protocols.sampling import SamplingParams

BUDGET = DraftBudget(max_nodes=32, max_depth=8, max_width=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(port: int, timeout_s: float = 180.0, drafter_args: tuple = ("--drafters", "ngram", "--replicas", "1"),
                  env: Optional[dict] = None, log: Optional[str] = None) -> subprocess.Popen:
    """``stree drafter-service`` in a child process (its own local Ray; ``env`` e.g. names its GPU); returns once
    its health check says SERVING. ``log``: a file for its output (default: discarded)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cmd = [sys.executable, "-m", "stree.cli", "drafter-service", "--port", str(port), "--bind", "127.0.0.1",
           "--ray-address", "local", *drafter_args]
    sink = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                            start_new_session=True, env=env)
    end = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"drafter service exited with code {proc.returncode}: {' '.join(cmd)}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:  # not listening yet
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                return proc
            time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"drafter service did not become healthy within {timeout_s:.0f}s")


def stop_service(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a ``start_service`` child: SIGTERM (it shuts its Ray down), SIGKILL after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def _context(vocab: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(0, vocab, (48,), generator=g).tolist()
    return (motif * (length // 48 + 1))[:length]


def _percentiles(times: list[float]) -> dict:
    t = sorted(times)
    return {"p50_ms": 1e3 * t[len(t) // 2], "p99_ms": 1e3 * t[min(len(t) - 1, int(len(t) * 0.99))],
            "mean_ms": 1e3 * statistics.mean(t)}


def draft_steps(drafter, context: list[int], steps: int, verify_s: float, vocab: int) -> dict:
    """Per step: time inside ``draft`` + ``commit`` (the verifier's wait); ``verify_s`` of GPU-like work between."""
    from stree.verifier.service.remote_drafter import RemoteDrafter

    if isinstance(drafter, RemoteDrafter):  # the budget lets the first Draft ride with Open
        session = drafter.open(list(context), SamplingParams(), budget=BUDGET)
    else:
        session = drafter.open(list(context), SamplingParams())
    gen = torch.Generator().manual_seed(0)
    times, nodes = [], []
    for i in range(steps + 10):
        t0 = time.perf_counter()
        tree = session.draft(BUDGET)
        path = tree.path_tokens(tree.leaves()[0])[1:]
        session.commit(path + [int(torch.randint(0, vocab, (1,), generator=gen))])
        dt = time.perf_counter() - t0
        if i >= 10:
            times.append(dt)
            nodes.append(tree.num_nodes)
        if verify_s:
            time.sleep(verify_s)  # the verifier waiting on the GPU (a CUDA sync releases the GIL too)
    stats = getattr(session, "stats", {})
    session.close()
    return {**_percentiles(times), "mean_nodes": statistics.mean(nodes), "timeouts": stats.get("timeouts", 0)}


def decode_steps(model, drafter, context: list[int], steps: int) -> dict:
    """Full decoding steps (draft + tree verify + commit) of ``model`` in the engine, drafted on the host by
    ``drafter`` (each engine step is one draft, one tree pass and one commit for the one sequence)."""
    from stree.verifier.decode.engine import Engine, Request

    new_tokens = steps * 40 + 400
    engine = Engine(model, "host", max_batch=1, max_seqlen=len(context) + new_tokens, budget=BUDGET)
    req = engine.add(Request(list(context), new_tokens, drafter_session=drafter.open(list(context), SamplingParams())))
    times = []
    for i in range(steps + 10):
        t0 = time.perf_counter()
        engine.step()
        if i >= 10:
            times.append(time.perf_counter() - t0)
    req.cancel()
    while engine.has_work:
        engine.step()
    return {**_percentiles(times), "mean_accepted_length": req.stats["mean_accepted_length"],
            "fallbacks": req.drafter_fallbacks}


def run(args) -> int:
    from stree.verifier.model.checkpoint import init_model, load_model
    from stree.verifier.service.remote_drafter import RemoteDrafter

    port = args.port or _free_port()
    proc = start_service(port)
    rows = []
    try:
        vocab = 512
        context = _context(vocab, args.context_len)
        local = create_drafter("ngram")
        remote = RemoteDrafter(f"grpc://127.0.0.1:{port}/ngram", deadline_s=1.0)
        serial = RemoteDrafter(f"grpc://127.0.0.1:{port}/ngram", deadline_s=1.0, pipeline=False)
        for verify_ms in (0.0, args.verify_ms):
            for label, drafter in (("in-process", local), ("remote, pipelined", remote), ("remote, serial", serial)):
                r = draft_steps(drafter, context, args.steps, verify_ms / 1e3, vocab)
                rows.append({"what": "draft+commit", "path": label, "verify_ms": verify_ms, **r})
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(init_model(os.path.join(tmp, "m"), d_model=64, n_layer=2, vocab_size=vocab, seed=0))
            for label, drafter in (("in-process", local), ("remote, pipelined", remote)):
                r = decode_steps(model, drafter, context, args.steps)
                rows.append({"what": "decode step (tiny model)", "path": label, "verify_ms": None, **r})
        remote.close()
        serial.close()
    finally:
        stop_service(proc)
    record = {"benchmark": "rpc", "date": date.today().isoformat(), "device": "cpu (loopback)",
              "cpus": os.cpu_count(), "command": "stree " + " ".join(sys.argv[1:]), "drafter": "ngram",
              "steps": args.steps, "context_len": args.context_len, "budget": vars(BUDGET), "rows": rows}
    print(f"{'what':<26}{'path':<20}{'verify ms':>10}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for r in rows:
        vm = "-" if r["verify_ms"] is None else f"{r['verify_ms']:.1f}"
        print(f"{r['what']:<26}{r['path']:<20}{vm:>10}{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['mean_ms']:>9.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("rpc", help="per-step cost of the remote drafter path vs in-process (loopback)")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--verify-ms", type=float, default=5.0,
                   help="simulated verifier work between commit and the next draft (the overlap pipelining uses)")
    p.add_argument("--port", type=int, default=0, help="drafter service port (0: a free one)")
    p.add_argument("--out", default="results/bench_rpc.json")
    p.set_defaults(func=run)
