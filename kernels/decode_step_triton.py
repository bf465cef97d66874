"""One-token decode step in Triton: SSM state update with its output, and the conv-state roll, in place.

``ssd_step_triton``: one program per (sequence, head, headdim block) reads its state slice once,
writes ``exp(dt A) H + dt x B^T`` back and returns ``y = C^T H + D x``. ``conv_step_triton``: one
program per (sequence, channel block). References: ``ssd_step_ref``, ``conv_step_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter


@triton.jit
def head_block(pid, H, heads_per_group, n_pblocks, BP: tl.constexpr):
    """``(b, h, g, offs_p)`` of a program that owns one headdim block of one head of one sequence."""
    bh = pid // n_pblocks
    h = bh % H
    return bh // H, h, h // heads_per_group, (pid % n_pblocks) * BP + tl.arange(0, BP)


@triton.jit
def update_state_block(h_bh_ptr, offs_p, offs_s, mask, s_hp, s_hs, decay, dtx, bv, cv):
    """``H = decay H + dtx B^T`` on one [P block, S block] tile, stored back; returns its ``C^T H`` part of y."""
    return update_state_block_to(h_bh_ptr, h_bh_ptr, offs_p, offs_s, mask, s_hp, s_hs, s_hp, s_hs, decay, dtx, bv, cv)


@triton.jit
def update_state_block_to(h_bh_ptr, o_bh_ptr, offs_p, offs_s, mask, s_hp, s_hs, s_op, s_os, decay, dtx, bv, cv):
    """``update_state_block`` reading the tile at ``h_bh_ptr`` and storing the new one at ``o_bh_ptr`` (may be the
    same)."""
    ptrs = h_bh_ptr + offs_p[:, None] * s_hp + offs_s[None, :] * s_hs
    new = decay * tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + dtx[:, None] * bv[None, :]
    tl.store(o_bh_ptr + offs_p[:, None] * s_op + offs_s[None, :] * s_os, new.to(o_bh_ptr.dtype.element_ty),
             mask=mask)
    return tl.sum(new * cv[None, :], 1)


@triton.jit
def _ssd_step_kernel(
    h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr,
    H, P, S, heads_per_group, n_pblocks,
    s_hb, s_hh, s_hp, s_hs,
    s_xb, s_xh, s_xp,
    s_db, s_dh,
    s_Bb, s_Bg, s_Bs,
    s_Cb, s_Cg, s_Cs,
    s_yb, s_yh, s_yp,
    BP: tl.constexpr, BS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b, h, g, offs_p = head_block(tl.program_id(0), H, heads_per_group, n_pblocks, BP)
    p_ok = offs_p < P
    dt = tl.load(dt_ptr + b * s_db + h * s_dh).to(tl.float32)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * s_xb + h * s_xh + offs_p * s_xp, mask=p_ok, other=0.0).to(tl.float32)
    y = tl.load(D_ptr + h).to(tl.float32) * x
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        s_ok = offs_s < S
        bv = tl.load(B_ptr + b * s_Bb + g * s_Bg + offs_s * s_Bs, mask=s_ok, other=0.0).to(tl.float32)
        cv = tl.load(C_ptr + b * s_Cb + g * s_Cg + offs_s * s_Cs, mask=s_ok, other=0.0).to(tl.float32)
        y += update_state_block(h_ptr + b * s_hb + h * s_hh, offs_p, offs_s, p_ok[:, None] & s_ok[None, :],
                                s_hp, s_hs, decay, dt * x, bv, cv)
    tl.store(y_ptr + b * s_yb + h * s_yh + offs_p * s_yp, y.to(y_ptr.dtype.element_ty), mask=p_ok)


@triton.jit
def conv_taps(cs_ptr, x_ptr, w_ptr, bias_ptr, ch, ok, s_sc, s_sk, s_xc, s_wc, s_wk,
               KM1: tl.constexpr, K_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
               OUT_DTYPE: tl.constexpr):
    """Conv output of channels ``ch`` for the new token (``cs_ptr``/``x_ptr`` at this sequence)."""
    k = tl.arange(0, K_P2)
    st = tl.load(cs_ptr + ch[:, None] * s_sc + k[None, :] * s_sk,
                 mask=ok[:, None] & (k < KM1)[None, :], other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + ch * s_xc, mask=ok, other=0.0).to(tl.float32)
    window = tl.where((k == KM1)[None, :], xv[:, None], st)
    w = tl.load(w_ptr + ch[:, None] * s_wc + k[None, :] * s_wk,
                mask=ok[:, None] & (k <= KM1)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(window * w, 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc.to(OUT_DTYPE).to(tl.float32)  # rounded like the unfused path


@triton.jit
def roll_conv_state(cs_ptr, x_ptr, ch, ok, s_sc, s_sk, s_xc, KM1: tl.constexpr, K_P2: tl.constexpr):
    """Shift channels ``ch`` of the conv state left by one and append the new input."""
    roll_conv_state_to(cs_ptr, cs_ptr, x_ptr, ch, ok, s_sc, s_sk, s_sc, s_sk, s_xc, KM1, K_P2)


@triton.jit
def roll_conv_state_to(cs_ptr, out_ptr, x_ptr, ch, ok, s_sc, s_sk, s_oc, s_ok, s_xc, KM1: tl.constexpr,
                       K_P2: tl.constexpr):
    """``roll_conv_state`` reading the state at ``cs_ptr`` and storing the rolled one at ``out_ptr`` (may be the
    same)."""
    k = tl.arange(0, K_P2)
    xv = tl.load(x_ptr + ch * s_xc, mask=ok, other=0.0)
    nxt = tl.load(cs_ptr + ch[:, None] * s_sc + (k + 1)[None, :] * s_sk,
                  mask=ok[:, None] & (k + 1 < KM1)[None, :], other=0.0)
    rolled = tl.where((k + 1 == KM1)[None, :], xv[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()  # every old column is read before any is overwritten
    tl.store(out_ptr + ch[:, None] * s_oc + k[None, :] * s_ok, rolled.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & (k < KM1)[None, :])


@triton.jit
def _conv_step_kernel(
    cs_ptr, x_ptr, w_ptr, bias_ptr, out_ptr, C,
    s_sb, s_sc, s_sk, s_xb, s_xc, s_wc, s_wk, s_ob, s_oc,
    KM1: tl.constexpr, K_P2: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(1)
    ch = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < C
    odt = out_ptr.dtype.element_ty
    out = conv_taps(cs_ptr + b * s_sb, x_ptr + b * s_xb, w_ptr, bias_ptr, ch, ch_ok, s_sc, s_sk, s_xc, s_wc, s_wk,
                    KM1, K_P2, HAS_BIAS, True, odt)
    roll_conv_state(cs_ptr + b * s_sb, x_ptr + b * s_xb, ch, ch_ok, s_sc, s_sk, s_xc, KM1, K_P2)
    tl.store(out_ptr + b * s_ob + ch * s_oc, out.to(odt), mask=ch_ok)


def ssd_step_triton(ssm_state, x, dt, A, Bm, Cm, D, *, out=None):
    """Triton ``ssd_step_ref``: updates ``ssm_state`` ``[B, H, P, S]`` in place, returns ``y`` ``[B, H, P]``."""
    if x.dim() != 3 or ssm_state.shape != (*x.shape, Bm.shape[-1]):
        raise ValueError(f"ssd_step: ssm_state {tuple(ssm_state.shape)} does not match x {tuple(x.shape)} "
                         f"and B {tuple(Bm.shape)}")
    if Bm.dim() != 3 or x.shape[1] % Bm.shape[1] or Cm.shape != Bm.shape:
        raise ValueError(f"ssd_step: B {tuple(Bm.shape)} / C {tuple(Cm.shape)} must be [B, G, S] with G | H")
    b, h, p = x.shape
    s = Bm.shape[2]
    y = torch.empty_like(x) if out is None else out
    if y.shape != x.shape:
        raise ValueError(f"ssd_step: out {tuple(y.shape)} must match x {tuple(x.shape)}")
    bp = 16
    bs = min(128, max(16, triton.next_power_of_2(s)))
    n_pblocks = triton.cdiv(p, bp)
    _ssd_step_kernel[(b * h * n_pblocks,)](
        ssm_state, x, dt, A, Bm, Cm, D, y, h, p, s, h // Bm.shape[1], n_pblocks,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *Bm.stride(), *Cm.stride(), *y.stride(),
        BP=bp, BS=bs, num_warps=4,
        **pdl.launch_args(),
    )
    return y


def conv_step_triton(conv_state, xBC, weight, bias, *, out=None):
    """Triton ``conv_step_ref``: returns ``silu(conv)`` ``[B, C]`` and rolls ``xBC`` into ``conv_state``."""
    if xBC.dim() != 2 or weight.dim() != 2 or weight.shape[0] != xBC.shape[1]:
        raise ValueError(f"conv_step: xBC {tuple(xBC.shape)} / weight {tuple(weight.shape)} must be [B, C] / [C, K]")
    b, c = xBC.shape
    km1 = weight.shape[1] - 1
    if conv_state.shape != (b, c, km1):
        raise ValueError(f"conv_step: conv_state {tuple(conv_state.shape)} must be [{b}, {c}, {km1}]")
    out = torch.empty_like(xBC) if out is None else out
    if out.shape != xBC.shape:
        raise ValueError(f"conv_step: out {tuple(out.shape)} must match xBC {tuple(xBC.shape)}")
    block_c = 256
    _conv_step_kernel[(triton.cdiv(c, block_c), b)](
        conv_state, xBC, weight, bias if bias is not None else weight, out, c,
        *conv_state.stride(), *xBC.stride(), *weight.stride(), *out.stride(),
        KM1=km1, K_P2=max(2, triton.next_power_of_2(km1 + 1)), HAS_BIAS=bias is not None,
        BLOCK_C=block_c, num_warps=4,
        **pdl.launch_args(),
    )
    return out
