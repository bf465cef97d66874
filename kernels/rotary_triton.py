"""Rotary embedding in one Triton launch: one program per (token, block of heads), any input strides.

Reference: ``rotary.rotary_ref`` (same float32 frequencies, products and rounding order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, f_ptr, y_ptr, T, H, D, HALF_DIM,
    s_xb, s_xt, s_xh, s_xd, s_pb, s_pt, s_yb, s_yt, s_yh, s_yd,
    BH: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = heads < H
    j = tl.arange(0, BF)
    j_ok = j < HALF_DIM
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.float32)
    freq = pos * tl.load(f_ptr + j, mask=j_ok, other=0.0)
    cos, sin = tl.cos(freq)[None, :], tl.sin(freq)[None, :]
    if INTERLEAVED:
        c1, c2 = 2 * j, 2 * j + 1
    else:
        c1, c2 = j, j + HALF_DIM
    x_row = x_ptr + b * s_xb + t * s_xt + heads[:, None] * s_xh
    y_row = y_ptr + b * s_yb + t * s_yt + heads[:, None] * s_yh
    m = h_ok[:, None] & j_ok[None, :]
    x1 = tl.load(x_row + c1[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + c2[None, :] * s_xd, mask=m, other=0.0).to(tl.float32)
    odt = y_ptr.dtype.element_ty
    tl.store(y_row + c1[None, :] * s_yd, (x1 * cos - x2 * sin).to(odt), mask=m)
    tl.store(y_row + c2[None, :] * s_yd, (x2 * cos + x1 * sin).to(odt), mask=m)
    rest = 2 * HALF_DIM + tl.arange(0, BD)  # channels past the rotary dim pass through
    mr = h_ok[:, None] & (rest < D)[None, :]
    tl.store(y_row + rest[None, :] * s_yd, tl.load(x_row + rest[None, :] * s_xd, mask=mr, other=0.0), mask=mr)


def rotary_triton(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Triton ``rotary_ref``: a new contiguous ``[B, T, H, D]`` tensor in ``x``'s dtype."""
    if x.dim() != 4 or pos.shape != x.shape[:2] or 2 * inv_freq.shape[0] > x.shape[3]:
        raise ValueError(f"rotary: x {tuple(x.shape)} must be [B, T, H, D] with pos {tuple(pos.shape)} [B, T] "
                         f"and a rotary dim of at most D (got {2 * inv_freq.shape[0]})")
    b, t, h, d = x.shape
    half = inv_freq.shape[0]
    if half == 0:
        return x
    y = torch.empty(b, t, h, d, dtype=x.dtype, device=x.device)
    bh = min(16, triton.next_power_of_2(h))
    _rotary_kernel[(b * t, triton.cdiv(h, bh))](
        x, pos, inv_freq, y, t, h, d, half, *x.stride(), *pos.stride(), *y.stride(),
        BH=bh, BF=max(2, triton.next_power_of_2(half)), BD=max(2, triton.next_power_of_2(max(1, d - 2 * half))),
        INTERLEAVED=interleaved, num_warps=2, enable_fp_fusion=False,
        **pdl.launch_args(),
    )
    return y
