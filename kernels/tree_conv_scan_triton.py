"""The Mamba2 layer's tree conv (+SiLU), dt and tree scan in ONE Triton launch (reference: ``tree_conv_scan_ref``).

One program per (sequence, head, headdim block), as in the single-tile tree scan: it convolves its
head's x channels and its group's B and C channels over every node (taps walk ``parents``; taps
above the root read the committed conv state), computes its head's dt, then runs the whole-tree
scan from those registers (ancestor mask by boolean squaring, tree cumsum, C H_0^T, C B^T, W X,
D skip). The B/C convs are recomputed by every head of a group (cheap next to a launch) and stored
by the group's first head only, dt by the first headdim block, so nothing is written twice.
The kernel takes trees of up to ``FUSED_LIMIT`` nodes, but is used by default only for float32 trees of up to
``FUSED_MAX_NODES`` (16 padded nodes), where it saves a launch per layer. Measured on the H200 (2026-11-27) once
the unfused tree conv had programs enough to fill the GPU: the demo target (fp32) took 505 against 526 us per tree
pass at 16 nodes (and within 2 % at 4-8), while at the bf16 Mamba2-2.7B shape the two kernels won at every size
(8.7 against 11.0 us per layer at 16 nodes; the fused tile recomputes the group's B/C convs per head), so half
precision takes the fused kernel only when asked (``FUSED_MAX_NODES_HALF`` = 0). Larger trees, ``d_state > 256``
or conv width 1 run the two unfused kernels (``tree_conv_dt_triton`` then ``tree_scan_triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.chain_conv_scan_triton import CHAIN_MAX_NODES, launch_chain_conv_scan
from stree.kernels.pdl import pdl_enter
from stree.kernels.pointwise import FUSED_ACTIVATIONS
from stree.kernels.tree_conv_scan import split_xbc
from stree.kernels.tree_conv_triton import (conv_scan_program, conv_tiles, softplus_dt, store_tree_acts,
                                            tree_conv1d_triton)
from stree.kernels.tree_scan_triton import (SMALL_MAX_STATE, c_dot_bt, small_tree_head,
                                            small_tree_mask, tree_scan_triton)

FUSED_MAX_NODES = 16
"""Largest padded float32 tree routed to the fused kernel by default (see the module docstring)."""
FUSED_MAX_NODES_HALF = 0
"""The same for bf16 / fp16 trees: none (the two kernels measured faster at every size)."""
FUSED_LIMIT = 32
"""Largest tree the fused kernel ever takes (``max_fused_nodes`` is capped to it): on the H200 (2026-11-27, triton
3.6, bf16 Mamba2-2.7B) its 64-node tile took 200 us at 16 channels x 4 warps and faulted at 16 x 8."""


@triton.jit
def _tree_conv_scan_kernel(
    xbc_ptr, cs_ptr, w_ptr, bias_ptr, par_ptr, dtr_ptr, dtb_ptr, A_ptr, D_ptr, h0_ptr,
    y_ptr, out_ptr, dt_ptr, pre_ptr,
    N, H, P, S, G, heads_per_group, dt_lo, dt_hi,
    s_xbc, s_cs, s_w, s_par, s_dtr, s_h0, s_y, s_out, s_dt, s_pre,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, IS_CHAIN: tl.constexpr, HAS_PRE: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, LOG2_BN: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b, h, pid_p, nodes, ok, offs_p, p_ok, offs_s, s_ok, x_ch, b_ch, c_ch = conv_scan_program(
        N, H, P, S, G, heads_per_group, BN, BP, BS)
    odt = y_ptr.dtype.element_ty
    par_b = par_ptr + b * s_par[0]
    xh, bv, cv = conv_tiles(xbc_ptr, cs_ptr, w_ptr, bias_ptr, par_b, out_ptr, b, nodes, ok, x_ch, p_ok, b_ch, c_ch,
                            s_ok, s_xbc, s_cs, s_w, s_par[1], K, HAS_BIAS, IS_CHAIN)
    raw = tl.load(dtr_ptr + b * s_dtr[0] + nodes * s_dtr[1] + h * s_dtr[2], mask=ok, other=0.0).to(tl.float32)
    a = tl.where(ok, softplus_dt(raw + tl.load(dtb_ptr + h).to(tl.float32), dt_lo, dt_hi, CLAMP), 0.0)

    anc = small_tree_mask(par_b, s_par[1], nodes, ok, LOG2_BN, IS_CHAIN)
    cb = c_dot_bt(cv, tl.trans(bv), HALF)
    y = small_tree_head(anc, cb, cv.to(tl.float32), a, xh.to(tl.float32), A_ptr, D_ptr, h0_ptr + b * s_h0[0],
                        s_h0, h, offs_p, p_ok, offs_s, s_ok, HALF)

    tl.store(y_ptr + b * s_y[0] + nodes[:, None] * s_y[1] + h * s_y[2] + offs_p[None, :] * s_y[3],
             y.to(odt), mask=ok[:, None] & p_ok[None, :])
    store_tree_acts(out_ptr, dt_ptr, pre_ptr, xbc_ptr + b * s_xbc[0], b, h, pid_p, heads_per_group, nodes, ok,
                    x_ch, p_ok, b_ch, c_ch, s_ok, xh, bv, cv, a, s_xbc, s_out, s_dt, s_pre, HAS_PRE)


def _check_inputs(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, A, D, ngroups, headdim, ssm_state):
    """Shape checks (no device sync); returns ``(b, n, c, h, p, s)``."""
    if xBC.dim() != 3 or ssm_state.dim() != 4:
        raise ValueError(f"tree_conv_scan: xBC {tuple(xBC.shape)} / ssm_state {tuple(ssm_state.shape)} must be "
                         "[B, N, C] / [B, H, P, S]")
    b, n, c = xBC.shape
    _, h, p, s = ssm_state.shape
    if ssm_state.shape[0] != b or p != headdim or ngroups < 1 or h % ngroups or c != h * p + 2 * ngroups * s:
        raise ValueError(f"tree_conv_scan: xBC {tuple(xBC.shape)} does not hold x, B, C of ssm_state "
                         f"{tuple(ssm_state.shape)} with headdim {headdim} and {ngroups} groups (G must divide H)")
    if conv_w.dim() != 2 or conv_w.shape[0] != c or conv_state.shape != (b, c, conv_w.shape[1] - 1):
        raise ValueError(f"tree_conv_scan: conv weight {tuple(conv_w.shape)} / conv_state "
                         f"{tuple(conv_state.shape)} must be [{c}, K] / [{b}, {c}, K-1]")
    if conv_b is not None and conv_b.shape != (c,):
        raise ValueError(f"tree_conv_scan: conv bias {tuple(conv_b.shape)} must be [{c}]")
    if parents.shape != (b, n) or dt_raw.shape != (b, n, h):
        raise ValueError(f"tree_conv_scan: parents {tuple(parents.shape)} / dt_raw {tuple(dt_raw.shape)} must be "
                         f"[{b}, {n}] / [{b}, {n}, {h}]")
    if dt_bias.shape != (h,) or A.shape != (h,) or D.shape != (h,):
        raise ValueError(f"tree_conv_scan: dt_bias {tuple(dt_bias.shape)}, A {tuple(A.shape)}, D {tuple(D.shape)} "
                         f"must be [{h}]")
    return b, n, c, h, p, s


def tree_conv_scan_triton(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation,
                          A, D, ngroups, headdim, ssm_state, *, out=None, pre=None, max_fused_nodes=None,
                          is_chain=False, block_p=None, num_warps=None, chain_max_nodes=None):
    """Triton ``tree_conv_scan_ref``: ``(y, xbc, dt)`` in one launch; both states are read only.

    ``out = (y, xbc, dt)`` (optional; a None entry is allocated) receives the outputs, ``pre`` (optional,
    ``[B, N, C]``) a copy of ``xBC`` for the commit. Trees over ``max_fused_nodes`` (at most ``FUSED_LIMIT``;
    default ``FUSED_MAX_NODES``, or ``FUSED_MAX_NODES_HALF`` in half precision) nodes run the two unfused
    kernels. ``is_chain=True`` treats every tree as the chain ``parents[i] = i - 1`` (no parent loads, no mask
    closure); ``block_p``/``num_warps`` tune the tile. Chains of up to ``chain_max_nodes`` nodes (default
    ``CHAIN_MAX_NODES``; at most ``FUSED_MAX_NODES``) run the sequential chain
    kernel (``chain_conv_scan_triton``) first, whatever ``max_fused_nodes`` says.
    """
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"tree_conv_scan kernel: activation {activation!r} is not fused (only silu)")
    b, n, c, h, p, s = _check_inputs(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, A, D, ngroups,
                                     headdim, ssm_state)
    dev = xBC.device
    y, xbc, dt = out if out is not None else (None, None, None)
    y = torch.empty(b, n, h, p, device=dev, dtype=xBC.dtype) if y is None else y
    xbc = torch.empty(b, n, c, device=dev, dtype=xBC.dtype) if xbc is None else xbc
    dt = torch.empty(b, n, h, device=dev, dtype=torch.float32) if dt is None else dt
    if pre is not None and (pre.shape != xBC.shape or pre.dtype != xBC.dtype):
        raise ValueError(f"tree_conv_scan: pre {tuple(pre.shape)} {pre.dtype} must be xBC's "
                         f"{tuple(xBC.shape)} {xBC.dtype}")
    if (y.shape != (b, n, h, p) or xbc.shape != (b, n, c) or dt.shape != (b, n, h) or y.dtype != xBC.dtype
            or xbc.dtype != xBC.dtype or dt.dtype != torch.float32):
        raise ValueError(f"tree_conv_scan: out {tuple(y.shape)} / {tuple(xbc.shape)} / {tuple(dt.shape)} must be "
                         f"[{b}, {n}, {h}, {p}] / [{b}, {n}, {c}] in {xBC.dtype} / [{b}, {n}, {h}] float32")
    width = conv_w.shape[1]
    half = xBC.dtype in (torch.float16, torch.bfloat16)
    lo, hi = dt_limit
    if chain_max_nodes is None:
        chain_max_nodes = CHAIN_MAX_NODES
    bp = _block_p(p, half, block_p)
    fits = s <= SMALL_MAX_STATE and width >= 2
    if fits and is_chain and n <= min(chain_max_nodes, FUSED_MAX_NODES):  # short chains: the sequential kernel
        launch_chain_conv_scan(xBC, conv_state, conv_w, conv_b, dt_raw, dt_bias, A, D, ssm_state, y, xbc, dt, pre,
                               h, p, s, ngroups, lo, hi, width, half, bp, num_warps)
        return y, xbc, dt
    if max_fused_nodes is None:
        max_fused_nodes = FUSED_MAX_NODES_HALF if half else FUSED_MAX_NODES
    if not fits or n > min(max_fused_nodes, FUSED_LIMIT):  # the two unfused kernels
        tree_conv1d_triton(xBC, conv_state, conv_w, conv_b, parents, activation, out=xbc,
                           dt=(dt_raw, dt_bias, dt_limit, dt), is_chain=is_chain, pre=pre)
        x, Bm, Cm = split_xbc(xbc, ngroups, p, s)
        tree_scan_triton(x, dt, A, Bm, Cm, D, parents, ssm_state, out=y, is_chain=is_chain)
        return y, xbc, dt
    bn = max(16, triton.next_power_of_2(n))
    _tree_conv_scan_kernel[(b * h, triton.cdiv(p, bp))](
        xBC, conv_state, conv_w, conv_b if conv_b is not None else conv_w, parents, dt_raw, dt_bias, A, D,
        ssm_state, y, xbc, dt, pre if pre is not None else xbc,
        n, h, p, s, ngroups, h // ngroups, float(lo), float(min(hi, 3.0e38)),
        *(t.stride() for t in (xBC, conv_state, conv_w, parents, dt_raw, ssm_state, y, xbc, dt)),
        (pre if pre is not None else xbc).stride(),
        K=width, HAS_BIAS=conv_b is not None, CLAMP=lo > 0.0 or hi < float("inf"), IS_CHAIN=is_chain,
        HAS_PRE=pre is not None,
        BN=bn, BP=bp, BS=max(16, triton.next_power_of_2(s)), LOG2_BN=bn.bit_length() - 1,
        HALF=half, num_warps=num_warps or (8 if half else 4),
        **pdl.launch_args(),
    )
    return y, xbc, dt


def _block_p(p: int, half: bool, block_p=None) -> int:
    """Headdim channels per program (``block_p`` if given). Tiles measured fastest on the H100 (2026-11-24): fp32 demo
    target 8.1 us at 16 channels x 4 warps (9.7 at 32 x 4), bf16 Mamba2-2.7B 9.0 us at 64 x 8 (10.9 at 32 x 4)."""
    return block_p or (min(64, max(16, triton.next_power_of_2(p))) if half else 16)
