"""Keyed uniforms (``keyed_random``) in one Triton launch: each program derives its row's key from the row's seed
and step, then hashes one block of indices.

The integer steps are those of ``keyed_random.keyed_uniform_ref`` (int64 masked to 32 bits), so the bits are the
same; the point is one launch instead of the dozens of elementwise PyTorch launches the reference takes (the key's
four hashes over ``[B]``, then two over ``[B, F * vocab]``), in every sampled step's graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.keyed_random import MASK32, MUL1, MUL2, lane_words
from stree.kernels.pdl import pdl_enter

BLOCK = 1024


@triton.jit
def _mix32(x, MUL1: tl.constexpr, MUL2: tl.constexpr, MASK: tl.constexpr):
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK
    return x ^ (x >> 16)


@triton.jit
def _keyed_uniform_kernel(seed_ptr, step_ptr, out_ptr, n, lane_a, lane_b, s_ob, MUL1: tl.constexpr,
                          MUL2: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    step = tl.load(step_ptr + row).to(tl.int64) & MASK
    lo, hi = seed & MASK, (seed >> 32) & MASK
    a = _mix32(lo ^ _mix32(step ^ lane_a.to(tl.int64), MUL1, MUL2, MASK), MUL1, MUL2, MASK)
    b = _mix32(hi ^ _mix32(step ^ lane_b.to(tl.int64), MUL1, MUL2, MASK), MUL1, MUL2, MASK)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix32(_mix32(a ^ idx.to(tl.int64), MUL1, MUL2, MASK) ^ b, MUL1, MUL2, MASK)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    tl.store(out_ptr + row * s_ob + idx, u, mask=idx < n)


def keyed_uniform_triton(seed: torch.Tensor, step: torch.Tensor, lane: int, n: int) -> torch.Tensor:
    """As ``keyed_uniform_ref``: ``[B]`` int64 seeds and steps -> ``[B, n]`` float32 uniforms."""
    seed, step = seed.contiguous(), step.contiguous()
    batch, n = seed.shape[0], int(n)
    out = torch.empty(batch, n, dtype=torch.float32, device=seed.device)
    if batch and n:
        lane_a, lane_b = lane_words(lane)
        _keyed_uniform_kernel[(batch, triton.cdiv(n, BLOCK))](
            seed, step, out, n, lane_a, lane_b, out.stride(0), MUL1=MUL1, MUL2=MUL2, MASK=MASK32, BLOCK=BLOCK,
            **pdl.launch_args(seed.device))
    return out
