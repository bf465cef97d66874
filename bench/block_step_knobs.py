"""Knobs of the one-launch Mamba2 block step (warps, programs per SM, projection columns per tile) against the three
ops, graphed us per block, weights rotating over copies worth more than L2. GPU only; a tuning probe.
Usage (repo root, after bench/gpu_start.sh): python3 bench/block_step_knobs.py OUT.txt
Recorded run: results/block-step-knobs-h100-20261124.txt (BENCHMARKS.md §0l). That run checked each knob against
states the timings had already advanced, so its "!" marks (error > 3e-2) are the check's fault, not the kernel's;
the check now starts from the untouched states. It also polled the barrier with plain loads, since reverted."""

import os
import sys

import torch

from stree.bench.common import random_block_params, tee
from stree.kernels.compare import rel_err
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.mamba_block_step import mamba_block_step_ref
from stree.kernels.mamba_block_step_triton import _RESIDENT, barrier_failed, mamba_block_step_triton
from stree.kernels.ops import mamba_block_step

say = tee(sys.argv[1])


KNOBS = [(4, 4, None), (2, 8, None), (2, 16, None), (4, 8, None), (4, 4, 16), (8, 2, 32), (8, 4, 16)]
g = torch.Generator(device="cuda").manual_seed(0)
torch.set_grad_enabled(False)
say("shape rows  split | " + " ".join(f"w{w}/{n}sm/bn{bn or '-'}" for w, n, bn in KNOBS))
for name, (d, h, hp, s, dtype), rows in (("pair", (256, 8, 64, 64, torch.float32), 1),
                                          ("130m", (768, 24, 64, 128, torch.bfloat16), 1),
                                          ("130m", (768, 24, 64, 128, torch.bfloat16), 4),
                                          ("2.7b", (2560, 80, 64, 128, torch.bfloat16), 1)):
    per_block = sum(t.numel() * t.element_size() for t in random_block_params(d, h, hp, s, dtype, g) if torch.is_tensor(t))
    ps = [random_block_params(d, h, hp, s, dtype, g) for _ in range(max(1, min(16, int(150e6 // per_block) + 1)))]
    c = h * hp + 2 * s
    x, r = torch.randn(rows, d, device="cuda", dtype=dtype), torch.randn(rows, d, device="cuda")
    cs, hs = torch.randn(rows, c, 3, device="cuda", dtype=dtype), torch.randn(rows, h, hp, s, device="cuda") * 0.3
    cs0, hs0 = cs.clone(), hs.clone()  # the timed runs below advance cs and hs: checks start from these
    want, _ = mamba_block_step_ref(x, r, ps[0], cs0.clone(), hs0.clone())
    os.environ["STREE_BLOCK_STEP"] = "split"
    t_split = graphed_us([lambda p=p: mamba_block_step(x, r, p, cs, hs) for p in ps], reps=20)
    row = []
    for w, n, bn in KNOBS:
        kw = dict(num_warps=w, programs_per_sm=n, block_n=bn)
        err = rel_err(mamba_block_step_triton(x, r, ps[0], cs0.clone(), hs0.clone(), **kw)[0], want)
        t = graphed_us([lambda p=p: mamba_block_step_triton(x, r, p, cs, hs, **kw) for p in ps], reps=20)
        row.append(f"{t:7.2f}{'!' if err > 3e-2 else ''}")
    say(f"{name:<5}{rows:>5}{t_split:>7.2f} | " + " ".join(f"{v:>14}" for v in row))
say(f"resident caps: {sorted(set(_RESIDENT.values()))}; barrier gave up: {barrier_failed(torch.device('cuda'))}")
