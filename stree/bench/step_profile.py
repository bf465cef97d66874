"""``stree bench step-profile``: where a speculative step's GPU time goes, phase by phase.

Runs a few eager engine steps of each tree shape under the torch profiler (phases marked with
``record_function``: draft, target tree pass, verify, target commit, draft commit), and prints the
kernels launched and the GPU time of each phase, then every shape's CUDA-graph replay time and the
graphed cost of each shape's draft alone, one draft-model step, one draft tree pass, one target step and
one target tree pass (TreeFlash's drafters too, given its checkpoint);
last, GPU time and launches by kernel name for each component, and cuBLAS's time for the model's
linear layers at the row counts a tree pass feeds them.
"""

from __future__ import annotations

import json

import torch

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.bench.common import add_pair_args, cancel_all, record_meta, save_record
from stree.kernels.cuda_graph import graphed_us, mean_replay_ms
from stree.protocols.token_tree import TreeBatch
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.decode.step_graphs import PLAIN, TREE, StepKey
from stree.verifier.model.checkpoint import load_model

PHASES = ("stree.draft", "stree.target_tree_pass", "stree.verify", "stree.target_commit", "stree.draft_commit")


def phase_table(engine: Engine, shape) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.graphs.enabled = False
    engine.add(Request(list(range(10, 40)), max_new_tokens=200))
    for _ in range(3):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    cancel_all(engine)
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


def _chain_trees(batch: int, n: int) -> TreeBatch:
    """``batch`` chains of ``n`` nodes (token 0) on the GPU: the trees the component timings feed."""
    nodes = torch.arange(n, device="cuda")
    return TreeBatch(torch.zeros(batch, n, dtype=torch.long, device="cuda"), (nodes - 1).expand(batch, n).contiguous(),
                     nodes.expand(batch, n).contiguous(), torch.full((batch,), n, device="cuda"))


def kernel_breakdown(fn, reps: int = 5, top: int = 30) -> dict:
    """GPU microseconds and launches per call of ``fn`` (eager), total and by kernel name (top ``top``)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_time <= 0:
            continue
        name = e.name[:60]
        calls, us = per.get(name, (0, 0.0))
        per[name] = (calls + 1, us + e.device_time)
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    return {"gpu_us": sum(us for _, us in per.values()) / reps,
            "launches": sum(c for c, _ in per.values()) / reps,
            "top": [[name, calls / reps, us / reps] for name, (calls, us) in rows[:top]]}


def _print_breakdown(name: str, table: dict) -> None:
    print(f"== {name}: {table['gpu_us']:.1f} us GPU, {table['launches']:.0f} launches")
    for kname, calls, us in table["top"]:
        print(f"   {us:8.1f} us {calls:5.1f}x  {kname}")


def _matmul_table(d_in: int, d_out: int, dtype, rows=(1, 2, 5, 8, 13, 16, 21, 32)) -> dict:
    """Graphed microseconds per ``[M, d_in] x [d_in, d_out]`` linear at tree-pass row counts: cuBLAS at M
    rows (``M5``) and ``ops.linear`` (``M5_padded``: at the row count its timing chose, pad included)."""
    from stree.kernels import ops

    w = torch.randn(d_out, d_in, device="cuda", dtype=dtype)
    out = {}
    for m in rows:
        x = torch.randn(m, d_in, device="cuda", dtype=dtype)
        out[f"M{m}"] = graphed_us([lambda: torch.nn.functional.linear(x, w)] * 20)
        with torch.no_grad():
            ops.linear(x, w)  # decides the padding outside the timing graph
            out[f"M{m}_padded"] = graphed_us([lambda: ops.linear(x, w)] * 20)
    return out


def component_breakdown(target, draft, batch: int, record: dict) -> None:
    """Per-kernel GPU time of each component (eager), printed and stored under ``record['kernels']``."""
    from stree.protocols.token_tree import DraftMode
    from stree.verifier.decode.verify_device import verify_batch

    b, dev = batch, "cuda"
    tables = record.setdefault("kernels", {})
    for name, model in (("target", target), ("draft", draft)):
        state = model.new_state(b, 512)
        ids = torch.zeros(b, dtype=torch.long, device=dev)
        tables[f"{name}_step"] = kernel_breakdown(lambda: model.step(ids, state))
        n = 5
        trees = _chain_trees(b, n)
        tables[f"{name}_tree_pass_5"] = kernel_breakdown(lambda: model.tree_forward(trees, state))
        _, acts = model.tree_forward(trees, state)
        path = torch.arange(n, device=dev).expand(b, n).contiguous()
        plen = torch.full((b,), 3, device=dev)

        def commit():
            model.commit(state, acts, path, plen)
            state.seqlen.zero_()
        tables[f"{name}_commit"] = kernel_breakdown(commit)
    logits = torch.randn(b, 5, target.vocab_size, device=dev)
    parents = torch.arange(-1, 4, device=dev).expand(b, 5).contiguous()
    tokens = torch.zeros(b, 5, dtype=torch.long, device=dev)
    valid = torch.ones(b, 5, dtype=torch.bool, device=dev)
    zeros = torch.zeros(b, device=dev)
    u = torch.zeros(b, 5, device=dev)
    tables["verify_greedy_5"] = kernel_breakdown(lambda: verify_batch(
        tokens, parents, valid, logits, zeros, zeros.long(), zeros + 1, DraftMode.DETERMINISTIC, None, u, u,
        max_depth=4, max_width=1, sampling=False))
    for name, table in tables.items():
        _print_breakdown(name, table)
    cfg = target.config
    mixer = target.backbone.layers[0].mixer
    d_in_proj, d_inner = mixer.in_proj.weight.shape[0], mixer.out_proj.weight.shape[1]
    record["matmul_us"] = {"in_proj": _matmul_table(cfg.d_model, d_in_proj, target.dtype),
                           "out_proj": _matmul_table(d_inner, cfg.d_model, target.dtype),
                           "lm_head": _matmul_table(cfg.d_model, cfg.padded_vocab_size, target.dtype),
                           # the Mamba2-2.7B projections in bf16, for the kernels issue's shape
                           "2.7b_in_proj_bf16": _matmul_table(2560, 10576, torch.bfloat16, (1, 2, 5, 16, 32)),
                           "2.7b_out_proj_bf16": _matmul_table(5120, 2560, torch.bfloat16, (1, 2, 5, 16, 32))}
    for name, row in record["matmul_us"].items():
        print(f"== linear {name} us/call:", " ".join(f"{k}={v:.1f}" for k, v in row.items()))
    from stree.kernels.linear import row_choices

    record["linear_row_padding"] = [[m, list(shape), dt, rows] for (m, shape, dt), rows in row_choices().items()]


def _cases(args, draft) -> list:
    """``(label, device drafter, tree spec)`` per profiled shape: the draft model's for ``--shapes``, and
    TreeFlash's conditional and marginal drafters on their default tree when ``--treeflash`` has a checkpoint."""
    from pathlib import Path

    cases = [(spec, DeviceTreeDrafter(draft), spec) for spec in args.shapes]
    if args.treeflash and (Path(args.treeflash) / "config.json").is_file():
        from stree.drafter_service.drafters.treeflash.device_draft import TreeFlashDeviceDrafter
        from stree.drafter_service.drafters.treeflash.drafter import default_tree
        from stree.verifier.model.treeflash import load_treeflash

        net = load_treeflash(args.treeflash, device="cuda", dtype=draft.dtype)
        cases += [(name, TreeFlashDeviceDrafter(net, conditional), default_tree(net))
                  for name, conditional in (("treeflash", True), ("treeflash-marginal", False))]
    return cases


def run(args) -> int:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    target = load_model(args.target, device="cuda", dtype=dtype)
    draft = load_model(args.draft, device="cuda", dtype=dtype)
    record: dict = {**record_meta("step-profile", torch.device("cuda")), "phases": {}, "graph_ms": {},
                    "components_ms": {}}
    record["draft_ms"] = {}
    for label, drafter, spec in _cases(args, draft):
        engine = Engine(target, drafter, [spec], max_batch=args.batch, max_seqlen=512)
        record["phases"][label] = phase_table(engine, engine.shapes[0])
        engine.graphs.enabled = True
        engine.add(Request(list(range(10, 40)), max_new_tokens=64))
        while engine.has_work:
            engine.step()
        key = StepKey(TREE, engine.shapes[0]) if spec != "none" else StepKey(PLAIN)
        if key in engine.graphs.graphs:
            record["graph_ms"][label] = mean_replay_ms(engine.graphs.graphs[key])
        if spec != "none":  # the draft alone (greedy), graphed: what the drafter costs per step
            shape, program, d = engine.shapes[0], engine.program, engine.drafter.drafter
            draft = lambda: d.draft(shape, program.roots, program.sampling, False)  # noqa: E731
            if isinstance(d, DeviceTreeDrafter):  # with the acts pass its commit replays (run at the commit)
                draft = lambda: (d.draft(shape, program.roots, program.sampling, False), d.acts)  # noqa: E731
            record["draft_ms"][label] = graphed_us([draft]) / 1e3
    b = args.batch
    for name, model in (("draft", draft), ("target", target)):
        state = model.new_state(b, 512)
        ids = torch.zeros(b, dtype=torch.long, device="cuda")
        record["components_ms"][f"{name}_step"] = graphed_us([lambda: model.step(ids, state)]) / 1e3
        for n in (5, 16):
            trees = _chain_trees(b, n)
            record["components_ms"][f"{name}_tree_pass_{n}"] = graphed_us([lambda: model.tree_forward(trees, state)]) / 1e3
    component_breakdown(target, draft, b, record)
    print(json.dumps({k: v for k, v in record.items() if k != "kernels"}, indent=1))
    if args.out:
        save_record(args.out, record)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("step-profile", help="kernels and GPU time per phase of a speculative step (GPU only)")
    add_pair_args(p)
    p.add_argument("--shapes", nargs="+", default=["none", "chain:4", "beam:5x3"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--treeflash", default="checkpoints/demo-treeflash",
                   help="also profile TreeFlash (and its marginal ablation) from this checkpoint, if it exists")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
