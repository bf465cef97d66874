"""The Mamba2 decode step's arithmetic as Triton helpers, shared by every kernel that must reproduce it bit for bit.

The decode step (``mamba_step_triton``), the exact tree pass (``ssm_walk_triton``), the exact commit
(``replay_triton`` with ``EXACT``) and the tree conv (``tree_conv_triton``) call these same functions, with explicit
``tl.fma`` where a product meets a sum, so no compiler choice of fused multiply-adds can make one kernel round
differently from another:

- ``conv_tap``: one tap of the depthwise causal conv, taps taken oldest first, then ``conv_finish`` adds the bias,
  applies SiLU and rounds to the activations' dtype;
- ``ssm_update``: ``H <- exp(dt A) H + (dt x) B^T`` on a (headdim block x d_state) tile;
- ``ssm_output``: ``y = sum_s H C + D x`` over the same tile (the tile's shape and warps fix the order of the sum,
  so the kernels that must agree use ``WALK_BLOCK_P`` x the whole padded d_state, and ``WALK_WARPS``);
- ``carry``: the state as the next step reads it (rounded to the state's dtype: bf16 states round every step).
"""

from __future__ import annotations

import triton
import triton.language as tl

WALK_BLOCK_P = 16
"""Headdim channels per program of every kernel that computes the SSM output ``y`` in exact numerics."""
WALK_WARPS = 4


def walk_tile(headdim: int) -> tuple[int, int]:
    """``(block_p, num_warps)`` of every kernel that computes ``y`` in exact numerics, whatever the batch."""
    return min(WALK_BLOCK_P, triton.next_power_of_2(headdim)), WALK_WARPS


def state_block(d_state: int) -> int:
    """The d_state tile of the step and the walk: the whole (padded) d_state, one block, so ``y`` is one sum."""
    return max(16, triton.next_power_of_2(d_state))


@triton.jit
def conv_tap(acc, v, w):
    """``acc + v w`` (one fused multiply-add in fp32); taps oldest first."""
    return tl.fma(v.to(tl.float32), w.to(tl.float32), acc)


@triton.jit
def conv_finish(acc, bias, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """The conv output after its taps: ``+ bias``, then SiLU (fp32; the caller rounds)."""
    if HAS_BIAS:
        acc = acc + bias.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


@triton.jit
def softplus_dt(v, dt_lo, dt_hi, CLAMP: tl.constexpr):
    """``softplus(v)`` (``v = dt_raw + dt_bias`` in fp32), clamped to ``[dt_lo, dt_hi]`` when ``CLAMP``."""
    v = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
    if CLAMP:
        v = tl.minimum(tl.maximum(v, dt_lo), dt_hi)
    return v


@triton.jit
def ssm_update(h, dt, a_h, x, bv):
    """``exp(dt A) h + (dt x) B^T``: ``h`` [P block, S block] fp32, ``dt``/``a_h`` scalars, ``x`` [P], ``bv`` [S]."""
    decay = tl.exp(dt * a_h)
    return tl.fma((dt * x)[:, None], bv[None, :], h * decay)


@triton.jit
def ssm_output(new, cv, dskip, x):
    """``y = sum_s new C + D x`` (``dskip`` the head's or channels' D)."""
    return tl.fma(dskip, x, tl.sum(new * cv[None, :], 1))


@triton.jit
def carry(new, STATE_DTYPE: tl.constexpr):
    """The state the next step reads: ``new`` rounded to the stored state's dtype (a no-op for fp32 states)."""
    return new.to(STATE_DTYPE).to(tl.float32)
