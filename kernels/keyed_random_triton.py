"""Keyed uniforms (``keyed_random``) in one Triton launch: each program hashes one block of one row's indices.

The integer steps are those of ``keyed_random.keyed_uniform_ref`` (int64 masked to 32 bits), so the bits are the
same; the point is one launch instead of a dozen elementwise PyTorch launches over a ``[B, F * vocab]`` draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.keyed_random import MASK32, MUL1, MUL2
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
def _keyed_uniform_kernel(keys_ptr, out_ptr, n, s_kb, s_ob, MUL1: tl.constexpr, MUL2: tl.constexpr,
                          MASK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(keys_ptr + row * s_kb).to(tl.int64)
    b = tl.load(keys_ptr + row * s_kb + 1).to(tl.int64)
    h = _mix32(_mix32(a ^ idx.to(tl.int64), MUL1, MUL2, MASK) ^ b, MUL1, MUL2, MASK)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    tl.store(out_ptr + row * s_ob + idx, u, mask=idx < n)


def keyed_uniform_triton(keys: torch.Tensor, n: int) -> torch.Tensor:
    """As ``keyed_uniform_ref``: ``[B, 2]`` int64 keys -> ``[B, n]`` float32 uniforms."""
    keys = keys.contiguous()
    batch, n = keys.shape[0], int(n)
    out = torch.empty(batch, n, dtype=torch.float32, device=keys.device)
    if batch and n:
        grid = (batch, triton.cdiv(n, BLOCK))
        _keyed_uniform_kernel[grid](keys, out, n, keys.stride(0), out.stride(0), MUL1=MUL1, MUL2=MUL2, MASK=MASK32,
                                    BLOCK=BLOCK, **pdl.launch_args(keys.device))
    return out
