"""Tiles of a Mamba2-2.7B layer's tree-pass kernels at 16 and 32 nodes (bf16, fp32 SSM state, batch 1): the fused
tree conv+scan against the two unfused kernels, each checked against ``tree_conv_scan_ref`` first on NaN-poisoned
outputs; the unfused tree conv (+dt, +pre-conv copy) by channel block x warps and the tree scan by headdim block x
warps; then the gated and the residual-add RMSNorm by warps, checked against their references. Graphed µs per
layer over rotated input sets (three L2 caches). GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/tree_layer_sweep.py OUT.txt"""

import math
import sys

import torch

from stree.bench.common import tee
from stree.bench.kernels import LAYER_SHAPES, complete_binary_parents, n_sets
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.norms import add_rmsnorm_ref, gated_rmsnorm_ref
from stree.kernels.norms_triton import add_rmsnorm_triton, gated_rmsnorm_triton
from stree.kernels.tree_conv_scan import split_xbc, tree_conv_scan_ref
from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton
from stree.kernels.tree_conv_triton import conv_tile_setting, tree_conv1d_triton
from stree.kernels.tree_scan import tree_scan_ref
from stree.kernels.tree_scan_triton import tree_scan_triton

say = tee(sys.argv[1])
torch.set_grad_enabled(False)
dev, gen, bf16 = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0), torch.bfloat16
sh = LAYER_SHAPES["2.7b"]
h, p, s, g, k = sh["nheads"], sh["headdim"], sh["d_state"], sh["ngroups"], sh["d_conv"]
c = h * p + 2 * g * s


def rnd(*size, scale=1.0, dtype=bf16):
    return (torch.randn(*size, generator=gen, device=dev) * scale).to(dtype)


def conv_scan_inputs(n):
    return dict(xBC=rnd(1, n, c), conv_state=rnd(1, c, k - 1), conv_w=rnd(c, k, scale=0.5), conv_b=rnd(c, scale=0.1),
                parents=torch.tensor(complete_binary_parents(n), device=dev)[None], dt_raw=rnd(1, n, h),
                dt_bias=rnd(h, scale=0.5) - 3.0, dt_limit=(0.0, float("inf")), activation="silu",
                A=-torch.exp(torch.rand(h, generator=gen, device=dev) * math.log(16.0)), D=torch.randn(h, device=dev),
                ngroups=g, headdim=p, ssm_state=torch.randn(1, h, p, s, generator=gen, device=dev) * 0.5)


def outs(n):
    return (torch.full((1, n, h, p), float("nan"), device=dev, dtype=bf16),
            torch.full((1, n, c), float("nan"), device=dev, dtype=bf16),
            torch.full((1, n, h), float("nan"), device=dev))


def err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


say(f"tree conv+scan, Mamba2-2.7B layer, bf16, fp32 SSM state, batch 1, {torch.cuda.get_device_name()}")
say("| nodes | variant | rel. err y / xbc / dt | graphed µs |")
say("|---|---|---|---|")
for n in (16, 32):
    sets = n_sets(h * p * s * 4 + n * c * 2 * 3)
    ins = [conv_scan_inputs(n) for _ in range(sets)]
    pres = [torch.empty(1, n, c, device=dev, dtype=bf16) for _ in range(sets)]
    ref = tree_conv_scan_ref(**ins[0])
    variants = {"unfused (conv, then scan), default tiles": dict(max_fused_nodes=0),
                "fused, 64 ch x 8 warps": dict(max_fused_nodes=32, block_p=64, num_warps=8)}
    for name, kw in variants.items():
        got = tree_conv_scan_triton(**ins[0], out=outs(n), pre=pres[0], chain_max_nodes=0, **kw)
        errs = " / ".join(f"{err(a, b):.1e}" for a, b in zip(got, ref))
        us = graphed_us([lambda i=i, q=q: tree_conv_scan_triton(**i, pre=q, chain_max_nodes=0, **kw)
                         for i, q in zip(ins, pres)], reps=30)
        say(f"| {n} | {name} | {errs} | {us:.2f} |")
    xbcs = [ref[1].clone() for _ in range(sets)]
    dts = [ref[2].clone() for _ in range(sets)]
    default = conv_tile_setting(n, c, 1)[1:]
    for bc, nw in [(None, None), (32, 2), (32, 4), (64, 2), (64, 4), (128, 4)]:
        def conv(i, q, o, d, bc=bc, nw=nw):
            return tree_conv1d_triton(i["xBC"], i["conv_state"], i["conv_w"], i["conv_b"], i["parents"], out=o, pre=q,
                                      dt=(i["dt_raw"], i["dt_bias"], i["dt_limit"], d), block_c=bc, num_warps=nw)
        o, d = outs(n)[1:]
        conv(ins[0], pres[0], o, d)
        errs = f"{err(o, ref[1]):.1e} / {err(d, ref[2]):.1e}"
        us = graphed_us([lambda i=i, q=q, o=o, d=d: conv(i, q, o, d) for i, q, o, d in zip(ins, pres, xbcs, dts)])
        say(f"| {n} | tree conv alone, {bc or default[0]} ch x {nw or default[1]} warps{' (default)' * (bc is None)} "
            f"| xbc / dt {errs} | {us:.2f} |")
    x, Bm, Cm = split_xbc(ref[1], g, p, s)
    scan_ref = tree_scan_ref(x, ref[2], ins[0]["A"], Bm, Cm, ins[0]["D"], ins[0]["parents"], ins[0]["ssm_state"])
    for bp, nw in [(None, None), (16, 4), (32, 8), (64, 4), (64, 8)]:
        y = outs(n)[0]
        tree_scan_triton(x, ref[2], ins[0]["A"], Bm, Cm, ins[0]["D"], ins[0]["parents"], ins[0]["ssm_state"], out=y,
                         block_p=bp, num_warps=nw)
        scans = [split_xbc(xb, g, p, s) for xb in xbcs]
        us = graphed_us([lambda i=i, sc=sc, d=d: tree_scan_triton(sc[0], d, i["A"], sc[1], sc[2], i["D"], i["parents"],
                                                                  i["ssm_state"], block_p=bp, num_warps=nw)
                         for i, sc, d in zip(ins, scans, dts)])
        say(f"| {n} | tree scan alone, {bp or 32} ch x {nw or 4} warps{' (default)' * (bp is None)} "
            f"| y {err(y, scan_ref):.1e} | {us:.2f} |")

say("\nnorms by warps (graphed µs), checked against the references")
say("| norm | rows | width | warps | rel. err | graphed µs |")
say("|---|---|---|---|---|---|")
for rows in (1, 16, 32):
    sets = 16
    zx = [rnd(rows, 2 * h * p + c + h) for _ in range(sets)]  # z is a column slice of in_proj's output
    ys = [rnd(rows, h * p) for _ in range(sets)]
    w = rnd(h * p, scale=0.2) + 1.0
    xs = [rnd(rows, sh["d_model"]) for _ in range(sets)]
    rs = [torch.randn(rows, sh["d_model"], device=dev) for _ in range(sets)]
    w2 = rnd(sh["d_model"], scale=0.2) + 1.0
    for nw in (4, 8, 16):
        got = gated_rmsnorm_triton(ys[0], zx[0][:, : h * p], w, h * p // g, 1e-5, num_warps=nw)
        e = err(got, gated_rmsnorm_ref(ys[0], zx[0][:, : h * p], w, h * p // g, 1e-5))
        us = graphed_us([lambda y=y, z=z: gated_rmsnorm_triton(y, z[:, : h * p], w, h * p // g, 1e-5, num_warps=nw)
                         for y, z in zip(ys, zx)], reps=30)
        say(f"| gated | {rows} | {h * p} | {nw} | {e:.1e} | {us:.2f} |")
        got = add_rmsnorm_triton(xs[0], rs[0], w2, 1e-5, True, num_warps=nw)[0]
        e = err(got, add_rmsnorm_ref(xs[0], rs[0], w2, 1e-5, True)[0])
        us = graphed_us([lambda x=x, r=r: add_rmsnorm_triton(x, r, w2, 1e-5, True, num_warps=nw)
                         for x, r in zip(xs, rs)], reps=30)
        say(f"| add | {rows} | {sh['d_model']} | {nw} | {e:.1e} | {us:.2f} |")
