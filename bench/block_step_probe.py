"""One Mamba2 block's decode step: the three ops (norm + in_proj, ``mamba_step``, gated norm + out_proj, each with
its own timed choice) against the one persistent launch (``mamba_block_step_triton``) at 1, 2 and 4 programs per
SM, in graphed us per block, at the demo pair's, the 130M and the 2.7B shapes and 1/4/16 rows. Weights rotate over
copies worth more than the L2 cache, as a whole model's step streams them. Each timed path is first checked
against ``mamba_block_step_ref``. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/block_step_probe.py OUT.txt"""

import sys

import torch

from stree.bench.common import random_block_params, tee
from stree.kernels import ops
from stree.kernels.compare import rel_err
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.mamba_block_step import mamba_block_step_ref, split_zxbcdt
from stree.kernels.mamba_block_step_triton import barrier_failed, mamba_block_step_triton

say = tee(sys.argv[1])


SHAPES = {"pair": (256, 8, 64, 64, torch.float32), "130m": (768, 24, 64, 128, torch.bfloat16),
          "2.7b": (2560, 80, 64, 128, torch.bfloat16)}


def split(x, r, p, cs, hs):
    zxbcdt, r2 = ops.add_rmsnorm_linear(x, r, p.norm_w, p.norm_eps, True, p.in_w)
    z, xBC, dt = split_zxbcdt(zxbcdt, p)
    y = ops.mamba_step(cs, hs, xBC, dt, p.conv_w, p.conv_b, p.dt_bias, p.A, p.D, 1, p.dt_limit, "silu")
    return ops.gated_rmsnorm_linear(y, z, p.gnorm_w, p.gnorm_w.numel(), 1e-5, False, p.out_w), r2


g = torch.Generator(device="cuda").manual_seed(0)
say(f"{'shape':<6}{'rows':>5}{'three ops us':>14}{'1/SM':>8}{'2/SM':>8}{'4/SM':>8}{'best x':>8}  max rel err")
torch.set_grad_enabled(False)
for name, (d, h, hp, s, dtype) in SHAPES.items():
    per_block = sum(t.numel() * t.element_size() for t in random_block_params(d, h, hp, s, dtype, g) if torch.is_tensor(t))
    copies = max(1, min(16, int(150e6 // per_block) + 1))
    ps = [random_block_params(d, h, hp, s, dtype, g) for _ in range(copies)]
    for rows in (1, 4, 16):
        c = h * hp + 2 * s
        x = torch.randn(rows, d, device="cuda", dtype=dtype)
        r = torch.randn(rows, d, device="cuda")
        cs = torch.randn(rows, c, 3, device="cuda", dtype=dtype)
        hs = torch.randn(rows, h, hp, s, device="cuda") * 0.3
        want, _ = mamba_block_step_ref(x, r, ps[0], cs.clone(), hs.clone())
        errs = [rel_err(split(x, r, ps[0], cs.clone(), hs.clone())[0], want)]
        for n in (1, 2, 4):
            errs.append(rel_err(mamba_block_step_triton(x, r, ps[0], cs.clone(), hs.clone(), programs_per_sm=n)[0],
                                want))
        t_split = graphed_us([lambda p=p: split(x, r, p, cs, hs) for p in ps], reps=20)
        t_fused = [graphed_us([lambda p=p, n=n: mamba_block_step_triton(x, r, p, cs, hs, programs_per_sm=n)
                               for p in ps], reps=20) for n in (1, 2, 4)]
        say(f"{name:<6}{rows:>5}{t_split:>14.2f}{t_fused[0]:>8.2f}{t_fused[1]:>8.2f}{t_fused[2]:>8.2f}"
            f"{t_split / min(t_fused):>7.2f}x  {max(errs):.1e}")
say(f"barrier gave up: {barrier_failed(torch.device('cuda'))}")
