"""The chain recurrence kernel against the fused tree kernel on chains of 1-16 nodes, at the demo target's
layer (fp32) and the 2.7B layer (bf16), batch 1 and 4: graphed us per layer, each config checked against
``tree_conv_scan_ref`` first. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/chain_scan_sweep.py OUT.txt"""

import sys

import torch

from stree.kernels.compare import rel_err
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.tree_conv_scan import tree_conv_scan_ref
from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton

out = open(sys.argv[1], "w")


def p(s):
    print(s)
    out.write(s + "\n")
    out.flush()


dev = "cuda"
SHAPES = {"pair fp32": (8, 64, 64, torch.float32), "2.7b bf16": (80, 64, 128, torch.bfloat16)}
for name, (h, hp, s, dtype) in SHAPES.items():
    for b in (1, 4):
        for n in (1, 2, 3, 5, 8, 16):
            g = torch.Generator(device=dev).manual_seed(n)
            c = h * hp + 2 * s
            rnd = lambda *sh, scale=1.0: (torch.randn(*sh, device=dev, generator=g) * scale).to(dtype)  # noqa: E731
            args = (rnd(b, n, c), rnd(b, c, 3), rnd(c, 4, scale=0.5), rnd(c),
                    (torch.arange(n, device=dev) - 1).expand(b, n).contiguous(), rnd(b, n, h) - 3.0, rnd(h),
                    (0.0, float("inf")), "silu", -torch.rand(h, device=dev) - 0.1, torch.randn(h, device=dev), 1, hp,
                    torch.randn(b, h, hp, s, device=dev) * 0.5)
            want = tree_conv_scan_ref(*args)
            # state copies past the L2 (as in a model, where each layer reads its own state)
            copies = max(4, min(20, int(100e6 // (b * h * hp * s * 4))))
            sets = [args[:-1] + (args[-1].clone(),) for _ in range(copies)]
            row = [f"{name} b={b} n={n:2d}:"]
            configs = [("tree", dict(chain=False))] + [
                (f"chain bp{bp}/nw{nw}", dict(chain=True, block_p=bp, num_warps=nw))
                for bp in (8, 16, 32, 64) for nw in (2, 4, 8)]
            for label, kw in configs:
                outs = tuple(torch.full_like(w, float("nan")) for w in want)
                tree_conv_scan_triton(*args, out=outs, is_chain=True, **kw)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                bad = any(rel_err(o, r) > tol or not torch.isfinite(o).all() for o, r in zip(outs, want))
                t = graphed_us([lambda kw=kw, a=a: tree_conv_scan_triton(*a, is_chain=True, **kw) for a in sets], reps=30)
                row.append(f"{label} {t:.1f}{' ERR' if bad else ''}")
            p(" | ".join(row))
