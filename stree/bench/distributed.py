"""``stree bench distributed``: the cluster deployment measured on one multi-GPU machine (or its CPU paths).

1. **Remote drafting.** ``stree drafter-service`` runs the model drafter as a Ray actor on its own GPU (the
   machine's last; the actor asks for ``num_gpus``), the target decodes on GPU 0 in this process. The same
   prompts decode greedily at batch 1 plainly, with the drafter in-process (drafting on the device, the fast
   path) and through the service: output equal token for token, and each path's milliseconds per step
   (``remote_step_overhead_ms``: remote minus in-process). Then the same prompts through the same service with
   drafting ahead (``RemoteDrafter(..., overlap=--draft-ahead)``): the service drafts trees for the likeliest
   outcomes of each tree while the target verifies it; output equal to plain greedy again, and
   ``overlap_vs_sequential``: its tokens/s over the remote path's without drafting ahead.
2. **Verifier replicas.** The OpenAI app on Ray Serve (``verifier.service.ray_serve``) with 1, 2, ... replicas,
   one GPU each, loaded by ``stree bench serve``'s client at ``--concurrency`` (``replica_scaling``: each count's
   output tokens/s over one replica's). Each replica keeps ``stree serve``'s default limits (8 engine slots), but
   the per-client stream limit rises to the concurrency: the load generator is one client.

Writes ``distributed-<card>-<date>.json`` (to ``--out``) with those three keys and the rows behind them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import date
from pathlib import Path

import torch

from stree.bench.prompt_sets import PROMPT_SETS, load_prompt_set
from stree.bench.rpc import _free_port, start_service, stop_service
from stree.bench.scale_pair import card_name
from stree.verifier.model.lm import DTYPES

SERVE_APP = """
import signal, sys, threading
from ray import serve
import ray
from stree.verifier.service.ray_serve import app_builder
model, replicas, gpus, port, dtype = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
per_client = int(sys.argv[6])  # the load generator is one client: its streams may fill every replica
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
ray.init(num_cpus=max(4, 2 * replicas), include_dashboard=False, logging_level="WARNING")
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(app_builder({"model_dir": model, "num_replicas": replicas, "gpus_per_replica": gpus, "dtype": dtype,
                       "limits": {"max_streams_per_client": per_client}}), route_prefix="/")
print("SERVING", flush=True)
stop.wait()
serve.shutdown()
ray.shutdown()
"""
"""A Ray Serve app of the verifier in its own process and its own local Ray; SIGTERM shuts both down."""


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def timed_greedy(target, prompts: list, n_new: int, **opts) -> tuple[list, dict]:
    """Greedy outputs of ``prompts`` one after another (batch 1) after one warm-up, and the wall time per step."""
    import stree

    stree.generate(target, prompts[:1], max_new_tokens=n_new, max_batch=1, **opts)
    t0 = time.perf_counter()
    outs = stree.generate(target, prompts, max_new_tokens=n_new, max_batch=1, **opts)
    wall = time.perf_counter() - t0
    steps = sum(o.stats["steps"] for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return [o.token_ids for o in outs], {"steps": steps, "tokens": tokens, "wall_s": wall,
                                         "ms_per_step": 1e3 * wall / max(steps, 1),
                                         "tokens_per_s": tokens / wall if wall else 0.0,
                                         "mean_accepted_length": tokens / max(steps, 1)}


def remote_drafting(args, prompts: list, gpus: int, logs: Path) -> dict:
    """Plain, in-process and remote greedy decoding of the same prompts (the remote drafter on the last GPU)."""
    from stree.protocols.drafter import DraftBudget
    from stree.verifier.model.checkpoint import load_model
    from stree.verifier.model.tokenizer import load_tokenizer
    from stree.verifier.service.remote_drafter import RemoteDrafter

    device = "cuda:0" if gpus else "cpu"
    target = load_model(args.target, device=device, dtype=getattr(torch, args.dtype))
    draft = load_model(args.draft, device=device, dtype=getattr(torch, args.dtype))
    tok = load_tokenizer(args.target)
    if tok is None:
        raise ValueError(f"{args.target} has no tokenizer.json: the prompt sets are text")
    ids = [tok.encode(p).ids[-args.max_prompt_tokens:] for p in prompts]
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(gpus - 1)  # the service's local Ray sees the drafter's GPU only
    port = _free_port()
    service_args = ("--drafters", "mamba", "--draft-model", args.draft, "--dtype", args.dtype,
                    "--option", f"mamba.tree={args.tree}",
                    "--replicas", "1",
                    "--gpus-per-replica", "1" if gpus else "0", "--ray-num-cpus", "4")
    proc = start_service(port, drafter_args=service_args, env=env, log=str(logs / "drafter-service.log"))
    try:
        budget = DraftBudget(max_nodes=32, max_depth=8, max_width=4)
        url = f"grpc://127.0.0.1:{port}/mamba"
        remote = RemoteDrafter(url, deadline_s=args.deadline_ms / 1e3, budget=budget)
        ahead = RemoteDrafter(url, deadline_s=args.deadline_ms / 1e3, budget=budget, overlap=args.draft_ahead)
        plain, p_row = timed_greedy(target, ids, args.max_new_tokens)
        local, l_row = timed_greedy(target, ids, args.max_new_tokens, drafter="mamba", draft_model=draft,
                                    tree=args.tree)
        far, r_row = timed_greedy(target, ids, args.max_new_tokens, drafter=remote)
        overlapped, o_row = timed_greedy(target, ids, args.max_new_tokens, drafter=ahead)
        remote.close()
        ahead.close()
    finally:
        stop_service(proc, 60)
    rows = [{"path": "plain", **p_row, "equals_plain_greedy": True},
            {"path": "in-process", **l_row, "equals_plain_greedy": local == plain},
            {"path": "remote", **r_row, "equals_plain_greedy": far == plain, **wait_split(remote.totals)},
            {"path": "remote+ahead", **o_row, "equals_plain_greedy": overlapped == plain,
             "draft_ahead": args.draft_ahead, **overlap_counts(ahead.totals)}]
    del target, draft
    if gpus:
        torch.cuda.empty_cache()
    return {"rows": rows, "remote_step_overhead_ms": r_row["ms_per_step"] - l_row["ms_per_step"],
            "overlap_vs_sequential": (o_row["tokens_per_s"] / r_row["tokens_per_s"] if r_row["tokens_per_s"]
                                      else None)}


def wait_split(totals) -> dict:
    """Where a remote step's wait for its tree went, per tree that the verifier asked for and waited on: the wait
    (``wait_ms_per_tree``) and the replica's drafting inside it (``replica_draft_ms_per_tree``); the rest is the
    round trip (gRPC, the service, the Ray actor call)."""
    waited = max(int(totals.get("waits", 0)), 1)
    return {"wait_ms_per_tree": 1e3 * float(totals.get("wait_s", 0.0)) / waited,
            "replica_draft_ms_per_tree": 1e3 * float(totals.get("replica_draft_s", 0.0)) / waited}


def overlap_counts(totals) -> dict:
    """What drafting ahead did over the timed and warm-up sessions: trees drafted ahead, commits, and how many
    commits took a tree drafted ahead at once (hits) or as it arrived just after (late hits)."""
    keys = ("ahead_trees", "overlap_commits", "overlap_hits", "overlap_late_hits")
    return {k: int(totals.get(k, 0)) for k in keys}


def serve_replicas(args, prompts: list, replicas: int, gpus: int, logs: Path) -> dict:
    """``replicas`` verifier replicas on Ray Serve (one GPU each where there are GPUs), loaded at
    ``--concurrency``: the load's summary (``stree bench serve``'s row)."""
    from stree.bench.serve import bench

    port = _free_port()
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(replicas))
    log = open(logs / f"serve-{replicas}.log", "wb")
    argv = [args.target, str(replicas), "1" if gpus else "0", str(port), args.dtype, str(args.concurrency)]
    proc = subprocess.Popen([sys.executable, "-c", SERVE_APP, *argv], stdout=subprocess.PIPE, stderr=log, env=env,
                            start_new_session=True)
    try:
        line = b""
        end = time.monotonic() + args.start_timeout
        while time.monotonic() < end and b"SERVING" not in line:
            if proc.poll() is not None:
                raise RuntimeError(f"Ray Serve with {replicas} replicas exited ({proc.returncode}); see {log.name}")
            line = proc.stdout.readline()
        if b"SERVING" not in line:
            raise RuntimeError(f"Ray Serve with {replicas} replicas did not start within {args.start_timeout:.0f}s")
        url = f"http://127.0.0.1:{port}"
        urllib.request.urlopen(f"{url}/v1/models", timeout=60).read()
        rows = asyncio.run(bench(url, prompts, [float("inf")], [args.concurrency], args.max_new_tokens, None, None, 0))
        return {"replicas": replicas, **rows[0]}
    finally:
        proc.terminate()  # the app shuts Serve and its own Ray down (other Ray instances here are left alone)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


def run(args) -> int:
    gpus = gpu_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "distributed-logs"
    logs.mkdir(exist_ok=True)
    texts = [text for _, text in load_prompt_set(args.prompt_set, args.num_prompts, args.prompt_file,
                                                 args.data_dir)]
    prompts = [texts[i % len(texts)] for i in range(args.num_prompts)]  # a set smaller than the load repeats
    from stree.verifier.service.remote_drafter import MAX_OVERLAP

    if not 1 <= args.draft_ahead <= MAX_OVERLAP:
        raise ValueError(f"--draft-ahead must be from 1 to {MAX_OVERLAP} trees, got {args.draft_ahead}")
    counts = [int(x) for x in args.replicas.split(",")]
    if any(c < 1 for c in counts) or (gpus and max(counts) > gpus):
        raise ValueError(f"--replicas must be counts from 1 to the GPUs here ({gpus or 'any on the CPU'}), "
                         f"got {args.replicas}")
    remote = remote_drafting(args, prompts[: args.remote_prompts], gpus, logs)
    serve_rows = [serve_replicas(args, prompts, r, gpus, logs) for r in counts]
    one = next((r["output_token_throughput"] for r in serve_rows if r["replicas"] == 1), None)
    scaling = {str(r["replicas"]): (r["output_token_throughput"] / one if one else None) for r in serve_rows}
    device = torch.device("cuda" if gpus else "cpu")
    record = {
        "benchmark": "distributed", "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus,
        "command": "stree " + " ".join(sys.argv[1:]), "target": args.target, "draft": args.draft,
        "tree": args.tree, "dtype": args.dtype, "prompt_set": args.prompt_set,
        "overlap_vs_sequential": remote["overlap_vs_sequential"], "draft_ahead": args.draft_ahead,
        "remote_step_overhead_ms": remote["remote_step_overhead_ms"], "replica_scaling": scaling,
        "remote_rows": remote["rows"], "serve_rows": serve_rows,
    }
    name = f"distributed-{card_name(device)}-{date.today().strftime('%Y%m%d')}.json"
    (out / name).write_text(json.dumps(record, indent=2))
    print(f"{'path':<14}{'ms/step':>9}{'tok/s':>9}{'tau':>6}  ==greedy")
    for r in remote["rows"]:
        print(f"{r['path']:<14}{r['ms_per_step']:>9.2f}{r['tokens_per_s']:>9.1f}{r['mean_accepted_length']:>6.2f}"
              f"  {r['equals_plain_greedy']}")
    far = remote["rows"][2]
    print(f"remote step overhead: {remote['remote_step_overhead_ms']:.2f} ms; a step waits "
          f"{far['wait_ms_per_tree']:.2f} ms for its tree, of which the replica drafts "
          f"{far['replica_draft_ms_per_tree']:.2f}")
    ahead_row = remote["rows"][-1]
    ratio = remote["overlap_vs_sequential"]
    print(f"overlap_vs_sequential: {'null' if ratio is None else f'{ratio:.3f}'} (drafting {args.draft_ahead} ahead; "
          f"{ahead_row['overlap_hits']} hits, {ahead_row['overlap_late_hits']} late hits of "
          f"{ahead_row['overlap_commits']} commits, {ahead_row['ahead_trees']} trees drafted ahead)")
    for r in serve_rows:
        print(f"{r['replicas']} replica(s): {r['output_token_throughput']:.1f} tok/s at concurrency "
              f"{args.concurrency} ({r['completed']} ok, {r['failed']} failed), x{scaling[str(r['replicas'])]:.2f}")
    print(f"wrote {out / name}")
    exact = all(r["equals_plain_greedy"] for r in remote["rows"])
    return 0 if exact and all(r["failed"] == 0 for r in serve_rows) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("distributed", help="remote drafting on its own GPU and verifier replicas on Ray Serve")
    p.add_argument("--target", default="checkpoints/demo-target", help="folder or Hub id")
    p.add_argument("--draft", default="checkpoints/demo-draft", help="the remote drafter's model")
    p.add_argument("--tree", default="chain:4", help="the drafter's tree (both paths)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights of the target, the drafter (both paths) and the Serve replicas")
    p.add_argument("--prompt-set", default="humaneval", choices=list(PROMPT_SETS))
    p.add_argument("--prompt-file", default=None, help="jsonl file of --prompt-set")
    p.add_argument("--data-dir", default=None, help="folder holding the prompt sets' standard files")
    p.add_argument("--num-prompts", type=int, default=256,
                   help="requests of the replica load (the prompt set repeats when it has fewer)")
    p.add_argument("--remote-prompts", type=int, default=8, help="prompts decoded on each drafting path")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--deadline-ms", type=float, default=1000.0,
                   help="remote drafter: wait this long for a tree (a measurement waits; serving uses 50)")
    p.add_argument("--draft-ahead", type=int, default=4, metavar="N",
                   help="trees the remote drafter drafts ahead per step on the overlapped path (1 to 64)")
    p.add_argument("--replicas", default="1,2", help="comma-separated verifier replica counts (one GPU each)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a Serve app may take to start")
    p.add_argument("--out", default="results")
    p.set_defaults(func=run)
