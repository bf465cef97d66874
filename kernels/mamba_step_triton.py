"""The whole Mamba2 decode step after in_proj in ONE Triton launch (reference: ``mamba_step_ref``).

One program per (sequence, head, headdim block): it convolves its x channels and its group's B/C
channels (K taps oldest first, recomputed per head: cheap), applies SiLU, softplus(dt + bias) with the clamp,
updates its state slice (the whole d_state in one tile) once and writes ``y + D x``, all through the helpers of
``recurrence_triton`` that the exact tree pass and commit share, so they reproduce its bits. Each program rolls its own x channels' conv
state; the B/C channels are shared by every program of a group, so the last of them to arrive
(an atomic counter per (sequence, group), reset by that program) rolls them after all have read.
Out of place (``new_states``, each row optionally stepping another row's state: beams following their
parents with no gather), nothing read is overwritten, so the group's first program rolls them, no counter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import numerics, pdl
from stree.kernels.mamba_step import check_step_rows
from stree.kernels.pdl import pdl_enter
from stree.kernels.arrival import counters
from stree.kernels.decode_step_triton import head_block, roll_conv_state, roll_conv_state_to
from stree.kernels.recurrence_triton import (WALK_WARPS, conv_finish, conv_tap, softplus_dt, ssm_output, ssm_update,
                                             state_block, walk_tile)

@triton.jit
def conv_window(cs_ptr, x_ptr, w_ptr, bias_ptr, ch, ok, s_sc, s_sk, s_xc, s_wc, s_wk,
                KM1: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Conv output of channels ``ch`` for the new token (``cs_ptr``/``x_ptr`` at this sequence): the K-1 committed
    inputs then the new one, oldest first, as every tree and prefill conv takes its taps; rounded to ``OUT_DTYPE``."""
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for k in tl.static_range(KM1):
        acc = conv_tap(acc, tl.load(cs_ptr + ch * s_sc + k * s_sk, mask=ok, other=0.0),
                       tl.load(w_ptr + ch * s_wc + k * s_wk, mask=ok, other=0.0))
    acc = conv_tap(acc, tl.load(x_ptr + ch * s_xc, mask=ok, other=0.0),
                   tl.load(w_ptr + ch * s_wc + KM1 * s_wk, mask=ok, other=0.0))
    bias = tl.load(bias_ptr + ch, mask=ok, other=0.0) if HAS_BIAS else 0.0
    return conv_finish(acc, bias, HAS_BIAS, SILU).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def mamba_step_item(
    item, cs_ptr, h_ptr, x_ptr, dtr_ptr, w_ptr, cb_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, ctr_ptr,
    src_ptr, ocs_ptr, oh_ptr,
    H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
    s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs, s_xb, s_xc, s_db, s_dh, s_wc, s_wk, s_yb, s_yc,
    s_osb, s_osc, s_osk, s_ohb, s_ohh, s_ohp, s_ohs,
    KM1: tl.constexpr, K_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    D_PER_CHANNEL: tl.constexpr, CLAMP: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
    HAS_SRC: tl.constexpr, SPLIT: tl.constexpr,
):
    """The step of work item ``item`` = one (sequence, head, headdim block), over the whole d_state (``BS`` >= S)
    in one tile. ``SPLIT``: the states at ``cs_ptr`` / ``h_ptr`` are only read (row ``src_ptr[b]`` with
    ``HAS_SRC``, else row b) and the new ones go to row b at ``ocs_ptr`` / ``oh_ptr``; with nothing overwritten that
    another program reads, the group's first program rolls the B/C conv state, no counter needed."""
    b, h, g, offs_p = head_block(item, H, heads_per_group, n_pblocks, BP)
    if HAS_SRC:
        sb = tl.load(src_ptr + b)
    else:
        sb = b
    p_ok = offs_p < P
    cs_b = cs_ptr + sb * s_sb
    x_b = x_ptr + b * s_xb
    odt = y_ptr.dtype.element_ty
    x_ch = h * P + offs_p
    x = conv_window(cs_b, x_b, w_ptr, cb_ptr, x_ch, p_ok, s_sc, s_sk, s_xc, s_wc, s_wk, KM1, HAS_BIAS, SILU, odt)
    raw = tl.load(dtr_ptr + b * s_db + h * s_dh).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    dt = softplus_dt(raw, dt_lo, dt_hi, CLAMP)
    if D_PER_CHANNEL:
        dskip = tl.load(D_ptr + x_ch, mask=p_ok, other=0.0).to(tl.float32)
    else:
        dskip = tl.load(D_ptr + h).to(tl.float32)
    b_base = H * P + g * S
    c_base = H * P + G * S + g * S
    offs_s = tl.arange(0, BS)
    s_ok = offs_s < S
    bv = conv_window(cs_b, x_b, w_ptr, cb_ptr, b_base + offs_s, s_ok, s_sc, s_sk, s_xc, s_wc, s_wk,
                     KM1, HAS_BIAS, SILU, odt)
    cv = conv_window(cs_b, x_b, w_ptr, cb_ptr, c_base + offs_s, s_ok, s_sc, s_sk, s_xc, s_wc, s_wk,
                     KM1, HAS_BIAS, SILU, odt)
    h_in = h_ptr + sb * s_hb + h * s_hh
    if SPLIT:
        h_out = oh_ptr + b * s_ohb + h * s_ohh
        o_hp = s_ohp
        o_hs = s_ohs
    else:
        h_out = h_in
        o_hp = s_hp
        o_hs = s_hs
    st_mask = p_ok[:, None] & s_ok[None, :]
    state = tl.load(h_in + offs_p[:, None] * s_hp + offs_s[None, :] * s_hs, mask=st_mask, other=0.0).to(tl.float32)
    new = ssm_update(state, dt, tl.load(A_ptr + h).to(tl.float32), x, bv)
    tl.store(h_out + offs_p[:, None] * o_hp + offs_s[None, :] * o_hs, new.to(h_out.dtype.element_ty), mask=st_mask)
    y = ssm_output(new, cv, dskip, x)
    tl.store(y_ptr + b * s_yb + x_ch * s_yc, y.to(odt), mask=p_ok)
    if SPLIT:
        ocs_b = ocs_ptr + b * s_osb
        roll_conv_state_to(cs_b, ocs_b, x_b, x_ch, p_ok, s_sc, s_sk, s_osc, s_osk, s_xc, KM1, K_P2)
        if (h % heads_per_group == 0) & (item % n_pblocks == 0):  # the group's first program: its B/C channels
            roll_conv_state_to(cs_b, ocs_b, x_b, b_base + offs_s, s_ok, s_sc, s_sk, s_osc, s_osk, s_xc, KM1, K_P2)
            roll_conv_state_to(cs_b, ocs_b, x_b, c_base + offs_s, s_ok, s_sc, s_sk, s_osc, s_osk, s_xc, KM1, K_P2)
    else:
        roll_conv_state(cs_b, x_b, x_ch, p_ok, s_sc, s_sk, s_xc, KM1, K_P2)
        # The group's B/C conv state: rolled by the last of its programs, after all have read it.
        tl.debug_barrier()
        arrived = tl.atomic_add(ctr_ptr + b * G + g, 1)
        if arrived == heads_per_group * n_pblocks - 1:
            roll_conv_state(cs_b, x_b, b_base + offs_s, s_ok, s_sc, s_sk, s_xc, KM1, K_P2)
            roll_conv_state(cs_b, x_b, c_base + offs_s, s_ok, s_sc, s_sk, s_xc, KM1, K_P2)
            tl.atomic_xchg(ctr_ptr + b * G + g, 0)


@triton.jit
def _mamba_step_kernel(
    cs_ptr, h_ptr, x_ptr, dtr_ptr, w_ptr, cb_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr, ctr_ptr, src_ptr, ocs_ptr, oh_ptr,
    H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
    s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs, s_xb, s_xc, s_db, s_dh, s_wc, s_wk, s_yb, s_yc,
    s_osb, s_osc, s_osk, s_ohb, s_ohh, s_ohp, s_ohs,
    KM1: tl.constexpr, K_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    D_PER_CHANNEL: tl.constexpr, CLAMP: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
    HAS_SRC: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    mamba_step_item(tl.program_id(0), cs_ptr, h_ptr, x_ptr, dtr_ptr, w_ptr, cb_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr,
                    ctr_ptr, src_ptr, ocs_ptr, oh_ptr, H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
                    s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs, s_xb, s_xc, s_db, s_dh, s_wc, s_wk, s_yb, s_yc,
                    s_osb, s_osc, s_osk, s_ohb, s_ohh, s_ohp, s_ohs,
                    KM1, K_P2, HAS_BIAS, SILU, D_PER_CHANNEL, CLAMP, BP, BS, HAS_SRC, SPLIT)


def mamba_step_triton(conv_state, ssm_state, xBC, dt_raw, conv_w, conv_b, dt_bias, A, D, ngroups,
                      dt_limit=(0.0, float("inf")), activation="silu", *, out=None, block_p=None, num_warps=None,
                      src_rows=None, new_states=None):
    """Triton ``mamba_step_ref``: both states updated in place, returns ``y + D x`` ``[B, H*P]``.
    ``block_p`` (headdim channels per program) and ``num_warps`` are tile knobs. In exact numerics the tile is the
    one every tree pass and prefill computes ``y`` with (``walk_tile``), whatever the batch; in fast numerics
    16 channels for fewer than 256 (sequence, head) pairs, else 32 (faster at batch 16 and 64).
    ``new_states = (conv, ssm)`` (rows of ``xBC``): the stepped states go there and the given ones are only read,
    row ``src_rows[b]`` (``[B]`` integers, optional) for row b, as ``mamba_step_ref``."""
    if activation not in ("silu", "swish"):
        raise ValueError(f"mamba_step kernel: activation {activation!r} is not fused (only silu)")
    b_in, h, p, s = ssm_state.shape
    b = xBC.shape[0]
    c = h * p + 2 * ngroups * s
    if xBC.shape != (b, c) or conv_w.dim() != 2 or conv_w.shape[0] != c:
        raise ValueError(f"mamba_step: xBC {tuple(xBC.shape)} / conv weight {tuple(conv_w.shape)} must be "
                         f"[{b}, {c}] / [{c}, K] for ssm_state {tuple(ssm_state.shape)}, ngroups {ngroups}")
    km1 = conv_w.shape[1] - 1
    if km1 < 1 or conv_state.shape != (b_in, c, km1):
        raise ValueError(f"mamba_step: conv_state {tuple(conv_state.shape)} must be [{b_in}, {c}, {km1}], K >= 2")
    if dt_raw.shape != (b, h) or h % ngroups or D.numel() not in (h, h * p):
        raise ValueError(f"mamba_step: dt {tuple(dt_raw.shape)} must be [{b}, {h}], ngroups {ngroups} must "
                         f"divide {h}, D ({D.numel()}) must have {h} or {h * p} entries")
    out_conv, out_ssm = check_step_rows(conv_state, ssm_state, b, src_rows, new_states)
    y = torch.empty(b, h * p, device=xBC.device, dtype=xBC.dtype) if out is None else out
    if y.shape != (b, h * p):
        raise ValueError(f"mamba_step: out {tuple(y.shape)} must be [{b}, {h * p}]")
    if numerics.exact():
        bp, warps = walk_tile(p)
    else:
        bp, warps = min(16 if b * h < 256 else 32, triton.next_power_of_2(p)), WALK_WARPS
    bp, warps = block_p or bp, num_warps or warps
    bs = state_block(s)
    n_pblocks = triton.cdiv(p, bp)
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi < float("inf")
    _mamba_step_kernel[(b * h * n_pblocks,)](
        conv_state, ssm_state, xBC, dt_raw, conv_w, conv_b if conv_b is not None else conv_w, dt_bias, A, D, y,
        counters(xBC.device, b * ngroups), src_rows if src_rows is not None else y, out_conv, out_ssm,
        h, p, s, ngroups, h // ngroups, n_pblocks, float(lo), float(min(hi, 3.0e38)),
        *conv_state.stride(), *ssm_state.stride(), *xBC.stride(), *dt_raw.stride(), *conv_w.stride(), *y.stride(),
        *out_conv.stride(), *out_ssm.stride(),
        KM1=km1, K_P2=triton.next_power_of_2(km1 + 1), HAS_BIAS=conv_b is not None, SILU=True,
        D_PER_CHANNEL=D.numel() == h * p and D.numel() != h, CLAMP=clamp, BP=bp, BS=bs,
        HAS_SRC=src_rows is not None, SPLIT=new_states is not None, num_warps=warps, enable_fp_fusion=False,
        **pdl.launch_args(xBC.device),
    )
    return y
