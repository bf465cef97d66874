"""``stree bench kernels``: GPU timings of the kernels per layer and of whole-model verify/draft steps.

(a) per layer, SSD part only: our tree scan on complete binary, width-k and chain trees vs mamba_ssm's
chunk scan of the same number of tokens vs unrolled paths (each root-to-leaf path its own sequence
through the chunk scan), plus the other kernels (tree conv, replay, decode step, attention vs SDPA);
(b) whole model (random weights): CUDA-graphed tree forward + commit vs plain decode step;
(c) the draft beam step (a batched ``step`` of the draft model). ``--check`` adds kernel-vs-reference
errors at the same shapes. Every timing is a CUDA-graph replay; inputs rotate over enough copies to
spill the L2 cache. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from stree.bench.common import kernel_settings
from stree.kernels.compare import rel_err
from stree.kernels.mamba_ssm_import import mamba_ssm_attr
from stree.kernels.cuda_graph import graphed_us
from stree.protocols.token_tree import ancestor_mask
from stree.verifier.model.lm import SSM_CACHE_DTYPES

LAYER_SHAPES = {
    "2.7b": dict(nheads=80, headdim=64, d_state=128, ngroups=1, d_model=2560, n_layer=64, d_conv=4),
    "130m": dict(nheads=24, headdim=64, d_state=128, ngroups=1, d_model=768, n_layer=24, d_conv=4),
}
# DESIGN.md section 5 (H100, bf16, CUDA graphs), microseconds; keys (shape, impl, nodes).
_TREE_ANCHOR_NODES = (15, 31, 63)
_TREE_ANCHORS_US = {  # (shape, impl): microseconds at 15, 31 and 63 nodes
    ("2.7b", "mamba_chunk_scan"): (27.4, 27.9, 31.6),
    ("2.7b", "paper_ref_tree_scan"): (45.7, 45.7, 48.4),
    ("2.7b", "unrolled_paths"): (94.8, 176.0, 332.0),
    ("130m", "mamba_chunk_scan"): (20.9, 21.8, 22.9),
    ("130m", "paper_ref_tree_scan"): (25.3, 25.5, 26.8),
    ("130m", "unrolled_paths"): (37.2, 61.9, 114.0),
}
ANCHORS_US = {
    **{(shape, impl, n): us for (shape, impl), row in _TREE_ANCHORS_US.items()
       for n, us in zip(_TREE_ANCHOR_NODES, row)},
    ("2.7b", "mamba_state_update", 1): 7.6, ("130m", "mamba_state_update", 1): 6.7,
}
MODEL_ANCHORS_MS = {  # full forward of L tokens, graphed (mamba_ssm), and the AR decode step
    ("2.7b", 1): 4.96, ("2.7b", 16): 5.34, ("2.7b", 64): 5.67, ("2.7b", 128): 6.40, ("2.7b", "decode"): 4.69,
    ("130m", 1): 1.03, ("130m", 16): 1.19, ("130m", 64): 1.20, ("130m", 128): 1.32, ("130m", "decode"): 1.04,
}


# ----- trees ---------------------------------------------------------------------------------
def complete_binary_parents(n: int) -> list[int]:
    """Heap-ordered complete binary tree of ``n`` nodes."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def width_k_parents(k: int, depth: int) -> list[int]:
    """Root plus ``k`` disjoint chains of ``depth`` nodes (a beam of width k), in BFS order."""
    parents = [-1]
    prev = [0] * k
    for _ in range(depth):
        level = []
        for b in range(k):
            parents.append(prev[b])
            level.append(len(parents) - 1)
        prev = level
    return parents


def chain_parents(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, cur = [], leaf
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        paths.append(path[::-1])
    return paths


SWEEP_TREES = ("binary-15", "binary-63", "width8x7")
SWEEP_HEADS_PER_PROGRAM = (1,)  # 2 and 4 measured slower everywhere (kernels/README.md)
CHECK_GROUPS = ("tree", "step", "prefill", "prefill_mamba", "attention")
BENCH_TREES = (
    [(f"binary-{n}", complete_binary_parents(n)) for n in (15, 31, 63)]
    + [(f"width{k}x7", width_k_parents(k, 7)) for k in (2, 4, 8)]
    + [(f"chain-{n}", chain_parents(n)) for n in (16, 64)]
)


# ----- mamba_ssm (optional baseline) ---------------------------------------------------------
def import_mamba_ssm():
    """(chunk_scan, state_update) from mamba_ssm (its Triton kernels, ``mamba_ssm_attr``), or (None, None)."""
    scan = mamba_ssm_attr("ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    update = mamba_ssm_attr("ops.triton.selective_state_update", "selective_state_update")
    if scan is None or update is None:
        print("mamba_ssm not usable; skipping its baselines", file=sys.stderr)
        return None, None
    return scan, update


# ----- timing --------------------------------------------------------------------------------
def n_sets(bytes_per_set: int, cap: int = 64) -> int:
    """Input copies to rotate through so the working set is about three L2 caches."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, min(cap, math.ceil(3 * l2 / max(bytes_per_set, 1))))


# ----- inputs --------------------------------------------------------------------------------
def layer_inputs(shape: dict, batch: int, n: int, dtype, device, gen) -> dict:
    h, p, s, g = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"]

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    dt = F.softplus(torch.randn(batch, n, h, generator=gen, device=device) * 0.5 - 3.0)
    A = -torch.exp(torch.rand(h, generator=gen, device=device) * math.log(16.0))
    return dict(
        x=rnd(batch, n, h, p), dt=dt, A=A, Bm=rnd(batch, n, g, s), Cm=rnd(batch, n, g, s),
        D=torch.randn(h, generator=gen, device=device),
        ssm_state=torch.randn(batch, h, p, s, generator=gen, device=device) * 0.5,
    )


# ----- (check) kernel vs reference at the real shapes ----------------------------------------
def _check_tree_kernels(shape_name, shape, dtype, tol, tree_name, par, device, gen, add) -> None:
    """Tree scan, tree conv and replay vs their references on one (padded) batch of two trees."""
    from stree.kernels import replay, replay_triton, tree_conv, tree_conv_triton, tree_scan, tree_scan_triton

    h, p, s, g, k = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"], shape["d_conv"]
    c = h * p + 2 * g * s
    batch = 2
    n = len(par) if par is not None else 200
    if par is None:
        parents = torch.stack([torch.cat([torch.tensor([-1]), torch.randint(0, 10**9, (n - 1,)) %
                                          torch.arange(1, n)]) for _ in range(batch)]).to(device)
    else:
        parents = torch.tensor(par, device=device).expand(batch, n).contiguous()
        parents[1, n // 2:] = 0  # second tree: padded, padding hangs off the root
    inp = layer_inputs(shape, batch, n, dtype, device, gen)
    ref = tree_scan.tree_scan_ref(**inp, parents=parents)
    out = torch.full_like(inp["x"], float("nan"))
    tree_scan_triton.tree_scan_triton(**inp, parents=parents, out=out)
    add("tree_scan", shape_name, dtype, rel_err(out, ref), tol, tree=tree_name)
    variants = [("tree_scan_tiled16", dict(block_m=16))] if n > 16 else []
    variants += [("tree_scan_hb4", dict(heads_per_program=4))] if n <= 64 and (h // g) % 4 == 0 else []
    for name, kw in variants:
        out = torch.full_like(inp["x"], float("nan"))
        tree_scan_triton.tree_scan_triton(**inp, parents=parents, out=out, **kw)
        add(name, shape_name, dtype, rel_err(out, ref), tol, tree=tree_name)
    xbc = torch.randn(batch, n, c, generator=gen, device=device).to(dtype)
    cs = torch.randn(batch, c, k - 1, generator=gen, device=device).to(dtype)
    w = torch.randn(c, k, generator=gen, device=device).to(dtype) * 0.5
    bias = torch.randn(c, generator=gen, device=device).to(dtype)
    out = torch.full_like(xbc, float("nan"))
    tree_conv_triton.tree_conv1d_triton(xbc, cs, w, bias, parents, out=out)
    add("tree_conv1d", shape_name, dtype, rel_err(out, tree_conv.tree_conv1d_ref(xbc, cs, w, bias, parents)),
        tol, tree=tree_name)
    dt_raw, dt_bias = torch.randn(batch, n, h, generator=gen, device=device).to(dtype), inp["D"].to(dtype)
    ref_out, ref_dt = tree_conv.tree_conv_dt_ref(xbc, cs, w, bias, parents, dt_raw, dt_bias, (0.0, 0.1))
    got_out, got_dt = tree_conv_triton.tree_conv_dt_triton(xbc, cs, w, bias, parents, dt_raw, dt_bias, (0.0, 0.1))
    add("tree_conv_dt_conv", shape_name, dtype, rel_err(got_out, ref_out), tol, tree=tree_name)
    add("tree_conv_dt_dt", shape_name, dtype, rel_err(got_dt, ref_dt), 1e-5, tree=tree_name)
    if n <= 64:  # the fused conv + dt + scan kernel (small trees)
        from stree.kernels import tree_conv_scan, tree_conv_scan_triton

        args = (xbc, cs, w, bias, parents, dt_raw, dt_bias, (0.0, 0.1), "silu", inp["A"], inp["D"], g, p,
                inp["ssm_state"])
        ref_y, ref_xbc, ref_dt = tree_conv_scan.tree_conv_scan_ref(*args)
        outs = (torch.full_like(inp["x"], float("nan")), torch.full_like(xbc, float("nan")),
                torch.full_like(ref_dt, float("nan")))
        tree_conv_scan_triton.tree_conv_scan_triton(*args, out=outs, max_fused_nodes=64)
        for part, got, want in zip(("y", "xbc", "dt"), outs, (ref_y, ref_xbc, ref_dt)):
            add(f"tree_conv_scan_{part}", shape_name, dtype, rel_err(got, want), 1e-5 if part == "dt" else tol,
                tree=tree_name)
    # replay along the first root-to-leaf path of each tree
    plist = parents.tolist()
    paths = [root_to_leaf_paths(pl)[-1] for pl in plist]
    m = max(len(q) for q in paths)
    path = torch.tensor([q + [0] * (m - len(q)) for q in paths], device=device)
    plen = torch.tensor([len(q) for q in paths], device=device)
    h1, c1 = inp["ssm_state"].clone(), cs.clone()
    h2, c2 = h1.clone(), c1.clone()
    replay.replay_ref(h1, c1, inp["x"], inp["dt"], inp["A"], inp["Bm"], xbc, path, plen)
    replay_triton.replay_triton(h2, c2, inp["x"], inp["dt"], inp["A"], inp["Bm"], xbc, path, plen)
    add("replay_ssm", shape_name, dtype, rel_err(h2, h1), min(tol, 1e-5), tree=tree_name)
    add("replay_conv", shape_name, dtype, rel_err(c2, c1), 1e-7, tree=tree_name)


def check_kernels(device, gen, rows: list, groups=CHECK_GROUPS) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def add(kernel, shape, dtype, err, tol, **extra):
        rows.append(dict(section="check", kernel=kernel, shape=shape, dtype=str(dtype).replace("torch.", ""),
                         rel_err=err, tol=tol, ok=bool(err == err and err < tol), **extra))

    for shape_name, shape in LAYER_SHAPES.items():
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            for tree_name, par in [BENCH_TREES[0], BENCH_TREES[2], BENCH_TREES[5], BENCH_TREES[7],
                                   ("random-200", None)] if "tree" in groups else []:
                try:
                    _check_tree_kernels(shape_name, shape, dtype, tol, tree_name, par, device, gen, add)
                except Exception as exc:  # noqa: BLE001 - report and go on with the other checks
                    traceback.print_exc()
                    rows.append(dict(section="check", kernel="tree-group", shape=shape_name, tree=tree_name,
                                     dtype=str(dtype), ok=False, error=f"{type(exc).__name__}: {exc}"[:300]))
            if "step" in groups:
                _check_step_kernels(shape_name, shape, dtype, tol, device, gen, add)
            if "prefill" in groups or "prefill_mamba" in groups:
                _check_prefill_kernels(shape_name, shape, dtype, tol, device, gen, add, "prefill_mamba" in groups)
    if "attention" in groups:
        _check_attention_kernels(device, gen, add)
    torch.backends.cuda.matmul.allow_tf32 = True


def _check_step_kernels(shape_name, shape, dtype, tol, device, gen, add) -> None:
    from stree.kernels import decode_step, decode_step_triton

    h, p, s, g, k = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"], shape["d_conv"]
    c = h * p + 2 * g * s
    one = layer_inputs(shape, 4, 1, dtype, device, gen)
    h1 = one["ssm_state"].clone()
    h2 = h1.clone()
    args = (one["x"][:, 0], one["dt"][:, 0], one["A"], one["Bm"][:, 0], one["Cm"][:, 0], one["D"])
    y1 = decode_step.ssd_step_ref(h1, *args)
    y2 = torch.full_like(y1, float("nan"))
    decode_step_triton.ssd_step_triton(h2, *args, out=y2)
    add("ssd_step_y", shape_name, dtype, rel_err(y2, y1), tol)
    add("ssd_step_state", shape_name, dtype, rel_err(h2, h1), 1e-5)
    xx = torch.randn(4, c, generator=gen, device=device).to(dtype)
    cs = torch.randn(4, c, k - 1, generator=gen, device=device).to(dtype)
    w = torch.randn(c, k, generator=gen, device=device).to(dtype) * 0.5
    bias = torch.randn(c, generator=gen, device=device).to(dtype)
    c1, c2 = cs.clone(), cs.clone()
    o1 = decode_step.conv_step_ref(c1, xx, w, bias)
    o2 = torch.full_like(o1, float("nan"))
    decode_step_triton.conv_step_triton(c2, xx, w, bias, out=o2)
    add("conv_step", shape_name, dtype, rel_err(o2, o1), tol)
    add("conv_step_state", shape_name, dtype, rel_err(c2, c1), 1e-7)
    _check_fused_step(shape_name, shape, dtype, tol, device, gen, add)


def _check_fused_step(shape_name, shape, dtype, tol, device, gen, add) -> None:
    """The one-launch decode step vs its reference at batch 1/4/16/64, NaN-poisoned output first."""
    from stree.kernels import mamba_step, mamba_step_triton

    h, p, s, g, k = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"], shape["d_conv"]
    c = h * p + 2 * g * s
    for batch in (1, 4, 16, 64):
        def rnd(*size, scale=1.0):
            return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

        a = dict(conv_state=rnd(batch, c, k - 1), ssm_state=rnd(batch, h, p, s).float(), xBC=rnd(batch, c),
                 dt_raw=rnd(batch, h), conv_w=rnd(c, k, scale=0.5), conv_b=rnd(c), dt_bias=rnd(h),
                 A=-torch.rand(h, generator=gen, device=device), D=rnd(h), ngroups=g)
        b = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in a.items()}
        y1 = mamba_step.mamba_step_ref(**a)
        y2 = torch.full_like(y1, float("nan"))
        mamba_step_triton.mamba_step_triton(**b, out=y2)
        add("mamba_step_y", shape_name, dtype, rel_err(y2, y1), tol, batch=batch)
        add("mamba_step_ssm_state", shape_name, dtype, rel_err(b["ssm_state"], a["ssm_state"]), 1e-5, batch=batch)
        add("mamba_step_conv_state", shape_name, dtype, rel_err(b["conv_state"], a["conv_state"]), 1e-7, batch=batch)


def _check_prefill_kernels(shape_name, shape, dtype, tol, device, gen, add, with_mamba: bool) -> None:
    from stree.kernels import chunk_scan, chunk_scan_triton

    h, p, s, g, k = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"], shape["d_conv"]
    c = h * p + 2 * g * s
    w = torch.randn(c, k, generator=gen, device=device).to(dtype) * 0.5
    bias = torch.randn(c, generator=gen, device=device).to(dtype)
    pre = layer_inputs(shape, 2, 200, dtype, device, gen)
    h1 = pre["ssm_state"].clone()
    y1 = chunk_scan.ssd_prefill_ref(pre["x"], pre["dt"], pre["A"], pre["Bm"], pre["Cm"], pre["D"], h1)
    for use_mamba in (False, True):
        if use_mamba and (not with_mamba or chunk_scan_triton.mamba_chunk_scan() is None):
            continue
        h2 = pre["ssm_state"].clone()
        y2 = chunk_scan_triton.ssd_prefill_triton(pre["x"], pre["dt"], pre["A"], pre["Bm"], pre["Cm"],
                                                  pre["D"], h2, use_mamba_ssm=use_mamba)
        name = "ssd_prefill_mamba_ssm" if use_mamba else "ssd_prefill"
        mtol = tol if not use_mamba else max(tol, 1e-2)  # mamba_ssm's fp32 products are tf32
        add(name + "_y", shape_name, dtype, rel_err(y2, y1), mtol)
        add(name + "_state", shape_name, dtype, rel_err(h2, h1), mtol)
    xb = torch.randn(2, 200, c, generator=gen, device=device).to(dtype)
    c1 = torch.randn(2, c, k - 1, generator=gen, device=device).to(dtype)
    c2 = c1.clone()
    add("conv_prefill", shape_name, dtype,
        rel_err(chunk_scan_triton.conv_prefill_triton(xb, c2, w, bias),
                chunk_scan.conv_prefill_ref(xb, c1, w, bias)), tol)
    add("conv_prefill_state", shape_name, dtype, rel_err(c2, c1), 1e-7)


def _check_attention_kernels(device, gen, add) -> None:
    """Hybrid attention layer shape: 32 query heads, 8 KV heads, head dim 128."""
    from stree.kernels import tree_attention, tree_attention_triton, tree_scan

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        b, n, hq, hkv, d, L = 2, 63, 32, 8, 128, 1200
        par = torch.tensor(complete_binary_parents(n), device=device).expand(b, n).contiguous()
        anc = ancestor_mask(par)
        q = torch.randn(b, n, hq, d, generator=gen, device=device).to(dtype)
        kc = torch.randn(b, L, hkv, d, generator=gen, device=device).to(dtype)
        vc = torch.randn(b, L, hkv, d, generator=gen, device=device).to(dtype)
        seqlen = torch.tensor([100, 1000], device=device)
        ref = tree_attention.tree_attention_ref(q, kc, vc, seqlen, anc)
        for splits in (None, 1, 5):
            out = torch.full_like(q, float("nan"))
            tree_attention_triton.tree_attention_triton(q, kc, vc, seqlen, anc, out=out, num_splits=splits)
            add("tree_attention", "hq32-kv8-d128", dtype, rel_err(out, ref), tol, splits=splits or "auto")
        add("tree_attention_sdpa", "hq32-kv8-d128", dtype,
            rel_err(tree_attention_triton.tree_attention_sdpa(q, kc, vc, seqlen, anc), ref), tol)
        path = torch.tensor([[0, 1, 3, 7, 15, 31], [0, 2, 6, 0, 0, 0]], device=device)
        plen = torch.tensor([6, 3], device=device)
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        tree_attention.kv_commit_ref(k1, v1, seqlen, path, plen)
        tree_attention_triton.kv_commit_triton(k2, v2, seqlen, path, plen)
        add("kv_commit", "hq32-kv8-d128", dtype, rel_err(torch.cat([k2, v2]), torch.cat([k1, v1])), 1e-7)


# ----- (a) per-layer timings -----------------------------------------------------------------
def bench_layers(device, gen, dtype, mamba, sweep: bool, quick: bool, rows: list, flush) -> None:
    from stree.kernels.tree_scan import tree_scan_ref
    from stree.kernels.tree_scan_triton import tree_scan_triton

    chunk_scan, state_update = mamba
    for shape_name, shape in LAYER_SHAPES.items():
        h, p, s, g = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"]
        state_bytes = h * p * s * 4
        for tree_name, par in BENCH_TREES:
            n = len(par)
            sets = n_sets(state_bytes + n * (h * p * 2 + 2 * g * s * 2))
            ins = [layer_inputs(shape, 1, n, dtype, device, gen) for _ in range(sets)]
            parents = torch.tensor(par, device=device)[None]

            def add(impl, us, tree_override=None, **extra):
                # Our tree scan is held against mamba_ssm's chunk scan of as many tokens (the target).
                anchor_impl = {"stree_tree_scan": "mamba_chunk_scan",
                               "torch_ref_tree_scan": "paper_ref_tree_scan"}.get(impl, impl)
                nodes = 1 if tree_override == "decode" else n
                anchor = (ANCHORS_US.get((shape_name, anchor_impl, nodes))
                          if tree_name.startswith("binary") or tree_override else None)
                rows.append(dict(section="layer", shape=shape_name, tree=tree_override or tree_name, nodes=nodes,
                                 impl=impl,
                                 us=round(us, 2), anchor_us=anchor,
                                 anchor=f"DESIGN.md 5: {anchor_impl}" if anchor else None, **extra))

            def timed(impl, calls, reps=30, **extra):
                try:
                    add(impl, graphed_us(calls, reps), **extra)
                except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, not fatal
                    rows.append(dict(section="layer", shape=shape_name, tree=tree_name, nodes=n, impl=impl,
                                     error=f"{type(exc).__name__}: {exc}"[:300], **extra))

            configs = [dict()]
            if sweep and tree_name in SWEEP_TREES:
                configs += [dict(heads_per_program=hb, block_p=bp, num_warps=nw)
                            for hb in SWEEP_HEADS_PER_PROGRAM for bp in (32, 64) for nw in (4, 8)]
                configs += [dict(block_m=bm, block_p=32, num_warps=4) for bm in (16, 32) if bm < n]
            for cfg in configs:
                timed("stree_tree_scan", [lambda i=i, c=cfg: tree_scan_triton(**i, parents=parents, **c) for i in ins],
                      config=cfg or "default")
            if not quick and tree_name.startswith("binary"):
                timed("torch_ref_tree_scan", [lambda i=ins[0]: tree_scan_ref(**i, parents=parents)], reps=5)
            paths = root_to_leaf_paths(par)
            if chunk_scan is not None:
                timed("mamba_chunk_scan", [lambda i=i: chunk_scan(
                    i["x"], i["dt"], i["A"], i["Bm"], i["Cm"], chunk_size=256, D=i["D"],
                    initial_states=i["ssm_state"]) for i in ins])
                # unrolled: one sequence per root-to-leaf path, each from (a copy of) the committed state
                depth = max(len(q) for q in paths)
                un = [layer_inputs(shape, len(paths), depth, dtype, device, gen) for _ in range(max(2, sets // 4))]
                timed("unrolled_paths", [lambda i=i: chunk_scan(
                    i["x"], i["dt"], i["A"], i["Bm"], i["Cm"], chunk_size=256, D=i["D"],
                    initial_states=i["ssm_state"]) for i in un], sequences=len(paths), length=depth)
            if tree_name == "binary-15" and state_update is not None:
                st = [layer_inputs(shape, 1, 1, dtype, device, gen) for _ in range(sets)]
                zero_bias = torch.zeros(h, 1, device=device).expand(h, p)  # its kernel wants one
                calls = [lambda i=i: state_update(
                    i["ssm_state"], i["x"][:, 0], i["dt"][:, 0, :, None].expand(-1, -1, p),
                    i["A"][:, None, None].expand(-1, p, s), i["Bm"][:, 0], i["Cm"][:, 0],
                    D=i["D"][:, None].expand(-1, p), dt_bias=zero_bias) for i in st]
                timed("mamba_state_update", calls, tree_override="decode")
            if tree_name == "binary-15":
                try:
                    bench_other_kernels(shape_name, shape, device, gen, dtype, sets, rows)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    traceback.print_exc()
                    rows.append(dict(section="layer", shape=shape_name, impl="other-kernels",
                                     error=f"{type(exc).__name__}: {exc}"[:300]))
            flush()
            print(f"[layer] {shape_name} {tree_name} done", file=sys.stderr, flush=True)


def bench_other_kernels(shape_name, shape, device, gen, dtype, sets, rows: list) -> None:
    from stree.kernels.decode_step_triton import conv_step_triton, ssd_step_triton
    from stree.kernels.replay_triton import replay_triton
    from stree.kernels.tree_conv_triton import tree_conv1d_triton

    h, p, s, g, k = shape["nheads"], shape["headdim"], shape["d_state"], shape["ngroups"], shape["d_conv"]
    c = h * p + 2 * g * s

    def add(impl, us, nodes, tree):
        rows.append(dict(section="layer", shape=shape_name, tree=tree, nodes=nodes, impl=impl, us=round(us, 2)))

    one = [layer_inputs(shape, 1, 1, dtype, device, gen) for _ in range(sets)]
    add("stree_ssd_step", graphed_us([lambda i=i: ssd_step_triton(
        i["ssm_state"], i["x"][:, 0], i["dt"][:, 0], i["A"], i["Bm"][:, 0], i["Cm"][:, 0], i["D"]) for i in one]),
        1, "decode")
    w = torch.randn(c, k, device=device).to(dtype)
    bias = torch.randn(c, device=device).to(dtype)
    cst = [torch.randn(1, c, k - 1, device=device).to(dtype) for _ in range(sets)]
    xs = [torch.randn(1, c, device=device).to(dtype) for _ in range(sets)]
    add("stree_conv_step", graphed_us([lambda a=a, x=x: conv_step_triton(a, x, w, bias) for a, x in zip(cst, xs)]),
        1, "decode")
    for n in (15, 63):
        par = torch.tensor(complete_binary_parents(n), device=device)[None]
        xb = [torch.randn(1, n, c, device=device).to(dtype) for _ in range(sets)]
        add("stree_tree_conv1d", graphed_us([lambda a=a, x=x: tree_conv1d_triton(x, a, w, bias, par)
                                             for a, x in zip(cst, xb)]), n, f"binary-{n}")
        ins = [layer_inputs(shape, 1, n, dtype, device, gen) for _ in range(sets)]
        depth = n.bit_length()
        path = torch.tensor([[(1 << d) - 1 for d in range(depth)]], device=device)  # leftmost root-to-leaf path
        plen = torch.tensor([depth], device=device)
        add("stree_replay", graphed_us([lambda i=i, a=a, x=x: replay_triton(
            i["ssm_state"], a, i["x"], i["dt"], i["A"], i["Bm"], x, path, plen) for i, a, x in zip(ins, cst, xb)]),
            n, f"binary-{n}-path{depth}")


def bench_attention(device, gen, dtype, rows: list) -> None:
    from stree.kernels.tree_attention_triton import kv_commit_triton, tree_attention_sdpa, tree_attention_triton

    hq, hkv, d, cap = 32, 8, 128, 8192
    for n in (15, 63):
        par = torch.tensor(complete_binary_parents(n), device=device)[None]
        anc = ancestor_mask(par)
        for used in (512, 2048, 8000):
            sets = 4
            kcs = [torch.randn(1, cap, hkv, d, device=device).to(dtype) for _ in range(sets)]
            vcs = [torch.randn(1, cap, hkv, d, device=device).to(dtype) for _ in range(sets)]
            q = torch.randn(1, n, hq, d, device=device).to(dtype)
            seqlen = torch.tensor([used - n], device=device)
            for impl, fn in (("stree_tree_attention", tree_attention_triton),
                             ("stree_tree_attention_no_min_chunk", functools.partial(tree_attention_triton, min_chunk=0)),
                             ("sdpa_full_cache", tree_attention_sdpa)):
                us = graphed_us([lambda k=k, v=v: fn(q, k, v, seqlen, anc) for k, v in zip(kcs, vcs)])
                rows.append(dict(section="attention", impl=impl, nodes=n, seqlen=used, cache=cap, us=round(us, 2)))
            us = graphed_us([lambda k=k, v=v: tree_attention_sdpa(q, k[:, :used], v[:, :used], seqlen, anc)
                             for k, v in zip(kcs, vcs)])
            rows.append(dict(section="attention", impl="sdpa_sliced_to_used", nodes=n, seqlen=used, cache=cap,
                             us=round(us, 2)))
        path = torch.tensor([[(1 << j) - 1 for j in range(n.bit_length())]], device=device)
        plen = torch.tensor([n.bit_length()], device=device)
        us = graphed_us([lambda k=k, v=v: kv_commit_triton(k, v, seqlen, path, plen) for k, v in zip(kcs, vcs)])
        rows.append(dict(section="attention", impl="stree_kv_commit", nodes=n, us=round(us, 2)))


# ----- (b)/(c) whole model -------------------------------------------------------------------
def copy_bandwidth_gbs(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), the weight-streaming yardstick."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    stop.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(stop) / 1e3) / 1e9


def mamba_ssm_decode_ms(shape: dict, dtype, vocab: int, prompt_len: int, batch: int = 1) -> float | None:
    """mamba_ssm's own MambaLMHeadModel one-token decode step for ``batch`` sequences, CUDA-graphed, on the
    same shape (or None)."""
    if import_mamba_ssm()[0] is None:
        return None
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        from mamba_ssm.utils.generation import InferenceParams

        cfg = MambaConfig(d_model=shape["d_model"], n_layer=shape["n_layer"], vocab_size=vocab,
                          ssm_cfg={"layer": "Mamba2", "use_mem_eff_path": False})
        model = MambaLMHeadModel(cfg, device="cuda", dtype=dtype).eval()
        params = InferenceParams(max_seqlen=prompt_len + 64, max_batch_size=batch)
        with torch.no_grad():
            model(torch.randint(0, vocab, (batch, prompt_len), device="cuda"), inference_params=params)
            params.seqlen_offset = prompt_len
            if batch == 1:  # which state dtype the anchor keeps (it decides the state's traffic)
                cache = params.key_value_memory_dict.get(0)
                print(f"mamba_ssm state dtypes (conv, ssm): {[t.dtype for t in cache] if cache else None}",
                      file=sys.stderr)
            tok = torch.randint(0, vocab, (batch, 1), device="cuda")
            ms = graphed_us([lambda: model(tok, inference_params=params, num_last_tokens=1)], reps=20) / 1000
        del model
        torch.cuda.empty_cache()
        return ms
    except Exception as exc:  # noqa: BLE001 - the baseline is optional; say why it is missing
        print(f"mamba_ssm decode baseline failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


MODEL_TREE_SIZES = (1, 4, 8, 16, 32, 64)


MODEL_BATCHES = (1, 4, 16, 64)
BATCH_TREE_NODES = 32


def _state_bytes(state) -> int:
    """Bytes of one sequence's recurrent state (SSM + conv), which a decode step reads and writes."""
    return sum(t[:1].numel() * t.element_size() for layer in state.layers
               for t in (getattr(layer, "ssm_state", None), getattr(layer, "conv_state", None)) if t is not None)


def _bench_batched(model, base, prompt, add, vocab: int, batches, weight_bytes: int, bandwidth: float,
                   mamba_ssm_ms=lambda b: None) -> None:
    """Decode step and 32-node verify step (tree forward + commit) at each batch size, per step and per sequence,
    beside the batch's floor (weights once + every sequence's state read and written, at copy bandwidth) and
    ``mamba_ssm_ms(b)``, mamba_ssm's graphed decode step at the same batch size."""
    from stree.protocols.token_tree import TokenTree, TreeBatch

    device = prompt.device
    per_seq_state = _state_bytes(base)
    par = complete_binary_parents(BATCH_TREE_NODES)
    path_nodes = root_to_leaf_paths(par)[0]
    for b in batches:
        if b == 1:
            continue  # batch 1 is timed above
        st = model.new_state(b, base.max_seqlen)
        model.prefill(prompt.expand(b, -1).contiguous(), st)
        s0 = st.seqlen.clone()
        tok = torch.randint(0, vocab, (b,), device=device)

        def decode(st=st, tok=tok, s0=s0):
            model.step(tok, st)
            st.seqlen.copy_(s0)

        ms = graphed_us([decode], reps=20) / 1000
        floor_b = (weight_bytes + 2 * b * per_seq_state) / (bandwidth * 1e9) * 1e3
        ref_b = mamba_ssm_ms(b)
        batch_cols = dict(batch=b, floor_batch_ms=round(floor_b, 4), mamba_ssm_batch_ms=ref_b and round(ref_b, 4))
        add("decode_step", 1, ms, ms_per_seq=round(ms / b, 4), **batch_cols)
        trees_list = [TokenTree.from_parents(torch.randint(0, vocab, (BATCH_TREE_NODES,)).tolist(), par)
                      for _ in range(b)]
        trees = TreeBatch.from_trees(trees_list).to(device)
        anc = TreeBatch.from_trees(trees_list).ancestor_mask().to(device)
        path = torch.tensor([path_nodes] * b, device=device)
        plen = torch.full((b,), len(path_nodes), device=device)
        holder = {}

        def tree_fwd(st=st, trees=trees, anc=anc):
            holder["logits"], holder["acts"] = model.tree_forward(trees, st, anc)

        def commit(st=st, path=path, plen=plen, s0=s0):
            model.commit(st, holder["acts"], path, plen)
            st.seqlen.copy_(s0)

        t_fwd = graphed_us([tree_fwd], reps=20) / 1000
        tree_fwd()
        t_commit = graphed_us([commit], reps=20) / 1000
        add("verify_step", BATCH_TREE_NODES, t_fwd + t_commit, ms_per_seq=round((t_fwd + t_commit) / b, 4),
            tree=f"binary-{BATCH_TREE_NODES}", **batch_cols)
        st = holder = None
        torch.cuda.empty_cache()


def engine_beam_draft_ms(model, prompt: torch.Tensor, depth: int = 4, beams: int = 3,
                         beam_steps: Optional[bool] = None) -> float:
    """Milliseconds of the engine's device beam draft (``DeviceTreeDrafter``, the path ``--tree beam`` runs),
    then the draft commit of the root, graphed: D M-row decode steps on a scratch state and one tree pass for
    the commit's activations (``beam_steps``, the default on a pure Mamba2 model), or D + 1 tree passes."""
    from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
    from stree.protocols.sampling import RowSampling
    from stree.protocols.tree_shape import TreeShape

    drafter = DeviceTreeDrafter(model, beam_steps=beam_steps)
    drafter.new_slots(1, prompt.shape[1] + 64)
    drafter.prefill_slot(0, prompt[0])
    shape, sampling = TreeShape("beam", depth=depth, beams=beams), RowSampling.greedy(1, model.device)
    roots = prompt[0, -1:].clone()
    path, path_len = torch.zeros(1, 1, dtype=torch.long, device=model.device), torch.ones(1, dtype=torch.long,
                                                                                         device=model.device)
    seq0 = drafter.state.seqlen.clone()

    def draft():
        drafter.draft(shape, roots, sampling, False)
        drafter.commit(path, path_len)
        drafter.state.seqlen.copy_(seq0)

    return graphed_us([draft], reps=20) / 1000


def bench_model(device, dtype, shapes, rows: list, flush, prompt_len: int = 256, batches=MODEL_BATCHES,
                ssm_caches=("float32",)) -> None:
    """(b) whole model, graphed: verify step (tree forward + LM head, then commit) per tree size, against the
    weight-streaming floor and mamba_ssm's graphed decode step measured in this run; (c) the 130M draft beam.
    Each of ``ssm_caches`` (``mamba_ssm_cache_dtype`` names) is timed in turn against the same anchors."""
    bandwidth = copy_bandwidth_gbs(device)  # once: every row's floor uses the same measured bandwidth
    for shape_name in shapes:
        refs: dict = {}

        def ref_ms(b, shape_name=shape_name, refs=refs):
            if b not in refs:
                refs[b] = mamba_ssm_decode_ms(LAYER_SHAPES[shape_name], dtype, 50280, prompt_len, b)
            return refs[b]

        for cache in ssm_caches:
            _bench_model_shape(device, dtype, shape_name, rows, prompt_len, batches, cache, ref_ms, bandwidth)
            flush()
            print(f"[model] {shape_name} ({cache} SSM state) done", file=sys.stderr, flush=True)


def _bench_model_shape(device, dtype, shape_name, rows: list, prompt_len: int, batches, ssm_cache: str,
                       ref_ms, bandwidth: float) -> None:
    """``bench_model`` for one shape and one SSM state dtype; ``ref_ms(b)``: mamba_ssm's decode at batch b;
    ``bandwidth``: the measured copy bandwidth (GB/s) the floors use."""
    from stree.drafter_service.drafters.mamba.beam_search import GraphedBeamSearch
    from stree.protocols.sampling import SamplingParams
    from stree.protocols.token_tree import TokenTree, TreeBatch
    from stree.verifier.model.checkpoint import random_init_
    from stree.verifier.model.config import ModelConfig
    from stree.verifier.model.lm import StreeLM

    vocab = 50280
    shape = LAYER_SHAPES[shape_name]
    anchor_ms = ref_ms(1)
    cfg = ModelConfig(d_model=shape["d_model"], n_layer=shape["n_layer"], vocab_size=vocab,
                      ssm_cfg={"layer": "Mamba2"})
    torch.manual_seed(0)
    model = random_init_(StreeLM(cfg), 0).to(device=device, dtype=dtype).eval()
    model.set_mamba_ssm_cache_dtype(ssm_cache)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    prompt = torch.randint(0, vocab, (1, prompt_len), device=device)
    base = model.new_state(1, prompt_len + 512)
    model.prefill(prompt, base)

    def add(mode, n, ms, **extra):
        rows.append(dict(section="model", shape=shape_name, mode=mode, nodes=n, ms=round(ms, 4),
                         ssm_cache=ssm_cache, floor_ms=round(floor_ms, 4),
                         mamba_ssm_decode_ms=anchor_ms and round(anchor_ms, 4),
                         anchor_ms=MODEL_ANCHORS_MS.get((shape_name, "decode")), **extra))

    state = base.clone()
    tok = torch.randint(0, vocab, (1,), device=device)
    seq0 = state.seqlen.clone()

    def decode():
        model.step(tok, state)
        state.seqlen.copy_(seq0)

    add("decode_step", 1, graphed_us([decode], reps=20) / 1000, weight_gb=round(weight_bytes / 1e9, 3),
        copy_gbs=round(bandwidth, 1))
    for n in MODEL_TREE_SIZES:
        par = complete_binary_parents(n)
        tree = TokenTree.from_parents(torch.randint(0, vocab, (n,)).tolist(), par)
        trees = TreeBatch.from_trees([tree]).to(device)
        anc = TreeBatch.from_trees([tree]).ancestor_mask().to(device)
        st = base.clone()
        path_nodes = root_to_leaf_paths(par)[0]
        path = torch.tensor([path_nodes], device=device)
        plen = torch.tensor([len(path_nodes)], device=device)
        holder = {}
        s0 = st.seqlen.clone()

        def tree_fwd():
            holder["logits"], holder["acts"] = model.tree_forward(trees, st, anc)

        def commit():
            model.commit(st, holder["acts"], path, plen)
            st.seqlen.copy_(s0)

        t_fwd = graphed_us([tree_fwd], reps=20) / 1000
        tree_fwd()
        t_commit = graphed_us([commit], reps=20) / 1000
        add("tree_forward", n, t_fwd, tree=f"binary-{n}")
        add("commit", n, t_commit, tree=f"binary-{n}", path_len=len(path_nodes))
        add("verify_step", n, t_fwd + t_commit, tree=f"binary-{n}")
    _bench_batched(model, base, prompt, add, vocab, batches, weight_bytes, bandwidth, ref_ms)
    if shape_name == "130m":  # (c) the draft model's depth-4 width-3 beam draft, all in one graph
        beam = GraphedBeamSearch(model, 4, 3, SamplingParams())
        beam(base, 7)
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            beam(base, 7)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        add("draft_beam_4x3", 12, 1e3 * times[len(times) // 2], note="one CUDA graph, incl. state copy-in")
        add("draft_beam_4x3_engine", 12, engine_beam_draft_ms(model, prompt, beam_steps=True),
            note="the engine's device draft: 4 three-row decode steps + 1 tree pass + commit, graphed")
        add("draft_beam_4x3_engine_tree", 12, engine_beam_draft_ms(model, prompt, beam_steps=False),
            note="the same draft by 5 tree passes + commit (beam_steps=False), graphed")
    model = base = state = None  # free this shape's weights before the next
    torch.cuda.empty_cache()


# ----- output --------------------------------------------------------------------------------
def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer = [r for r in rows if r.get("section") == "layer" and "us" in r and r.get("config", "default") == "default"]
    trees = [t for t, _ in BENCH_TREES]
    impls = ["stree_tree_scan", "mamba_chunk_scan", "unrolled_paths", "torch_ref_tree_scan"]
    fig, axes = plt.subplots(1, len(LAYER_SHAPES) + 1, figsize=(18, 5))
    for ax, shape_name in zip(axes, LAYER_SHAPES):
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            vals = [next((r["us"] for r in layer if r["shape"] == shape_name and r["tree"] == t and r["impl"] == impl),
                         0.0) for t in trees]
            if any(vals):
                ax.bar([i + j * width for i in range(len(trees))], vals, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(trees))], trees, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("µs per layer (CUDA graph)")
        ax.set_title(f"SSD part of one layer, {shape_name} shape")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    model = [r for r in rows if r.get("section") == "model" and r["mode"] in ("verify_step", "decode_step")]
    ax = axes[-1]
    for shape_name in LAYER_SHAPES:
        pts = sorted((r for r in model if r["shape"] == shape_name), key=lambda r: r["nodes"])
        if pts:
            ax.plot([r["nodes"] for r in pts if r["mode"] == "verify_step"],
                    [r["ms"] for r in pts if r["mode"] == "verify_step"], "o-", label=f"{shape_name} verify step")
            dec = [r for r in pts if r["mode"] == "decode_step"]
            if dec:
                ax.axhline(dec[0]["ms"], ls="--", lw=1, color="gray")
                ax.axhline(dec[0]["floor_ms"], ls=":", lw=1, color="black")
                if dec[0].get("mamba_ssm_decode_ms"):
                    ax.axhline(dec[0]["mamba_ssm_decode_ms"], ls="-.", lw=1, color="red")
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("ms (CUDA graph)")
    ax.set_title("verify step (dashed: our decode, dash-dot: mamba_ssm decode, dotted: HBM floor)", fontsize=8)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None (named in the record: which anchor ran)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _kernels_per_layer() -> dict:
    """Launches per Mamba2 mixer call (step / 8-node tree / commit), reference vs Triton, on the GPU."""
    from stree.bench.launches import mixer_launches
    from stree.kernels import backend
    from stree.verifier.model.config import ModelConfig
    from stree.verifier.model.mamba2_mixer import Mamba2Mixer

    try:
        mixer = Mamba2Mixer(ModelConfig(d_model=64, n_layer=1, vocab_size=64,
                                        ssm_cfg=dict(d_state=16, headdim=16))).cuda()
        mixer_launches(mixer, which="triton")  # allocates the arrival counters once
        counts = {which: mixer_launches(mixer, which=which) for which in ("torch", "triton")}
    except Exception as exc:  # noqa: BLE001 - a count is a nicety; never lose the run for it
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        backend.use("triton")  # mixer_launches resets the forced backend; the bench runs Triton
    return counts


def run(args) -> int:
    if not torch.cuda.is_available():
        raise ValueError("stree bench kernels needs a CUDA GPU (none is visible)")
    from stree.kernels import backend

    backend.use("triton")
    device = torch.device("cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    mamba = import_mamba_ssm()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    result = dict(
        device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
        triton=__import__("triton").__version__, mamba_ssm=mamba[0] is not None, dtype=args.dtype,
        command=" ".join(sys.argv), rows=[], causal_conv1d=package_version("causal_conv1d"),
        kernel_settings=kernel_settings(), kernels_per_layer=_kernels_per_layer(),
    )
    print(f"kernels per Mamba2 layer (launch count, tiny mixer on the GPU): {result['kernels_per_layer']}", file=sys.stderr)
    rows = result["rows"]

    def flush():
        result["seconds"] = round(time.time() - t0, 1)
        (out_dir / "kernels.json").write_text(json.dumps(result, indent=1))

    check_groups = (args.check or CHECK_GROUPS) if args.check is not None else ()
    parts = [("check", lambda: check_kernels(device, gen, rows, check_groups))] if check_groups else []
    parts += [(name, fn) for name, fn in (
        ("layer", lambda: bench_layers(device, gen, dtype, mamba, args.sweep, args.quick, rows, flush)),
        ("attention", lambda: bench_attention(device, gen, dtype, rows)),
        ("model", lambda: bench_model(device, dtype, args.model_shapes, rows, flush, batches=args.batches,
                                      ssm_caches=args.mamba_ssm_cache_dtype)),
    ) if name in args.parts]
    for name, fn in parts:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - keep the other parts' numbers
            traceback.print_exc()
            rows.append(dict(section=name, error=f"{type(exc).__name__}: {exc}"[:500]))
        flush()
        print(f"[{name}] done at {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    plot(result["rows"], out_dir / "kernels.png")
    print_summary(result["rows"])
    return 0


def print_summary(rows: list[dict]) -> None:
    for r in rows:
        if r.get("section") == "check" and not r["ok"]:
            print(f"CHECK FAILED {r}")
    fails = sum(1 for r in rows if r.get("section") == "check" and not r["ok"])
    checks = sum(1 for r in rows if r.get("section") == "check")
    if checks:
        print(f"checks: {checks - fails}/{checks} ok")
    best: dict = {}
    for r in rows:
        if r.get("section") == "layer" and r.get("impl") == "stree_tree_scan" and "us" in r:
            key = (r["shape"], r["tree"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for (shape, tree), r in best.items():
        print(f"best tree-scan config {shape:5} {tree:14} {r['us']:8.2f} us {r['config']}")
    for r in rows:
        if "error" in r:
            print(f"ERROR {r}")
        elif r.get("section") == "layer" and "us" in r and r.get("config", "default") == "default":
            print(f"{r['shape']:5} {r['tree']:14} {r['impl']:22} {r['us']:9.2f} us  anchor {r.get('anchor_us')}")
        elif r.get("section") == "attention":
            print(f"attn n={r['nodes']:3} seqlen={r.get('seqlen', '-')!s:5} {r['impl']:22} {r['us']:9.2f} us")
        elif r.get("section") == "model":
            print(f"model {r['shape']:5} {r.get('ssm_cache', 'float32'):8} {r['mode']:16} n={r['nodes']:3} "
                  f"b={r.get('batch', 1):3} {r['ms']:8.3f} ms"
                  f"  per seq {r.get('ms_per_seq', r['ms'])}  floor {r.get('floor_batch_ms', r['floor_ms']):.3f}"
                  f"  mamba_ssm decode {r.get('mamba_ssm_batch_ms', r.get('mamba_ssm_decode_ms'))}"
                  f"  (DESIGN anchor {r.get('anchor_ms')})")


def add_parser(sub) -> None:
    p = sub.add_parser("kernels", help="GPU timings of the tree kernels per layer and per model step")
    p.add_argument("--out", default="out/bench-kernels", help="folder for kernels.json and kernels.png")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--parts", nargs="+", choices=["layer", "attention", "model"], default=["layer", "attention", "model"])
    p.add_argument("--model-shapes", nargs="+", choices=list(LAYER_SHAPES), default=list(LAYER_SHAPES))
    p.add_argument("--check", nargs="*", choices=CHECK_GROUPS, default=None,
                   help="also compare kernels with their references (all groups, or the ones named)")
    p.add_argument("--batches", nargs="+", type=int, default=list(MODEL_BATCHES),
                   help="batch sizes for the per-sequence decode and 32-node verify timings (model part)")
    p.add_argument("--mamba-ssm-cache-dtype", nargs="+", choices=SSM_CACHE_DTYPES, default=["float32"],
                   help="SSM state dtypes to time the model part with, each in turn (auto: the model's dtype, "
                        "as mamba_ssm keeps it)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tree-scan tile configurations")
    p.add_argument("--quick", action="store_true", help="skip the slow PyTorch reference timings")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


if __name__ == "__main__":
    import argparse

    _parser = argparse.ArgumentParser(prog="python -m stree.bench.kernels")
    add_parser(_parser.add_subparsers(dest="bench", required=True))
    _args = _parser.parse_args()
    sys.exit(_args.func(_args))
