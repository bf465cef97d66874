"""``stree bench step-profile``: where a speculative step's GPU time goes, phase by phase.

Runs a few eager engine steps of each tree shape under the torch profiler (phases marked with
``record_function``: draft, target tree pass, verify, target commit, draft commit), and prints the
kernels launched and the GPU time of each phase, then every shape's CUDA-graph replay time and the
graphed cost of one draft-model step, one draft tree pass, one target step and one target tree pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.bench.kernels import graphed_us
from stree.protocols.token_tree import TreeBatch
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import load_model

PHASES = ("stree.draft", "stree.target_tree_pass", "stree.verify", "stree.target_commit", "stree.draft_commit")


def _replay_ms(graph, reps: int = 50) -> float:
    """Mean GPU milliseconds of one replay of a captured graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def phase_table(engine: Engine, shape) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.cuda_graphs = False
    engine.shapes = [shape]
    engine.add(Request(list(range(10, 40)), max_new_tokens=200))
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    for r in engine.slots:
        if r is not None:
            r.cancel()
    while engine.has_work:
        engine.step()
    out = {}
    events = prof.events()
    for name in PHASES:
        spans = [e for e in events if e.name == name]
        if not spans:
            continue
        kernels = sum(_kernel_count(s) for s in spans)
        gpu_us = sum(s.device_time_total for s in spans)
        out[name] = {"kernels_per_step": kernels / len(spans), "gpu_us_per_step": gpu_us / len(spans)}
    return out


def _kernel_count(event) -> int:
    """Kernels launched by ``event`` and every op under it."""
    return len(getattr(event, "kernels", [])) + sum(_kernel_count(c) for c in event.cpu_children)


def run(args) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    target = load_model(args.target, device="cuda", dtype=dtype)
    draft = load_model(args.draft, device="cuda", dtype=dtype)
    record: dict = {"phases": {}, "graph_ms": {}, "components_ms": {}}
    for spec in args.shapes:
        engine = Engine(target, DeviceTreeDrafter(draft), [spec], max_batch=args.batch, max_seqlen=512)
        record["phases"][spec] = phase_table(engine, engine.shapes[0])
        engine.cuda_graphs = True
        engine.add(Request(list(range(10, 40)), max_new_tokens=64))
        while engine.has_work:
            engine.step()
        key = ("tree", engine.shapes[0], False) if spec != "none" else ("none", False)
        if key in engine.graphs:
            record["graph_ms"][spec] = _replay_ms(engine.graphs[key])
    b = args.batch
    for name, model in (("draft", draft), ("target", target)):
        state = model.new_state(b, 512)
        ids = torch.zeros(b, dtype=torch.long, device="cuda")
        record["components_ms"][f"{name}_step"] = graphed_us([lambda: model.step(ids, state)]) / 1e3
        for n in (5, 16):
            parents = torch.arange(-1, n - 1, device="cuda").expand(b, n).contiguous()
            trees = TreeBatch(torch.zeros(b, n, dtype=torch.long, device="cuda"), parents,
                              torch.arange(n, device="cuda").expand(b, n).contiguous(),
                              torch.full((b,), n, device="cuda"))
            record["components_ms"][f"{name}_tree_pass_{n}"] = graphed_us([lambda: model.tree_forward(trees, state)]) / 1e3
    print(json.dumps(record, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("step-profile", help="kernels and GPU time per phase of a speculative step (GPU only)")
    p.add_argument("--target", default="checkpoints/demo-target")
    p.add_argument("--draft", default="checkpoints/demo-draft")
    p.add_argument("--shapes", nargs="+", default=["none", "chain:4", "beam:5x3"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
