"""The Mamba2 layer's conv + dt + scan over a CHAIN of nodes, as a recurrence in registers (one launch).

Reference: ``tree_conv_scan_ref`` with ``parents[i] = i - 1``. A chain needs no ancestor mask: one
program per (sequence, head, headdim block) convolves its channels over every node at once (as the
fused tree kernel does), then walks the nodes in order, carrying its ``[headdim block, d_state]``
slice of the SSM state in registers: ``H = exp(dt A) H + dt x B^T`` and ``y = C H + D x`` per node.
That is the decode step's work per node with the state read once and never written (a tree pass
leaves the state alone), instead of the tree kernel's quadratic form padded to 16 nodes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels.decode_step_triton import head_block
from stree.kernels.tree_conv_triton import softplus_dt, tree_conv_tile

CHAIN_MAX_NODES = 16
"""Longest chain the recurrence takes (its loop is sequential; longer chains go to the tree kernels)."""
CHAIN_MAX_STATE = 256
"""Largest d_state it takes: one ``[headdim block, d_state]`` state tile lives in registers."""


@triton.jit
def _row(tile, rows, t):
    """Row ``t`` of a ``[BN, X]`` register tile (a masked sum: registers cannot be indexed)."""
    return tl.sum(tl.where((rows == t)[:, None], tile, 0.0), 0)


@triton.jit
def _chain_conv_scan_kernel(
    xbc_ptr, cs_ptr, w_ptr, bias_ptr, dtr_ptr, dtb_ptr, A_ptr, D_ptr, h0_ptr,
    y_ptr, out_ptr, dt_ptr,
    N, H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
    s_xbc, s_cs, s_w, s_dtr, s_h0, s_y, s_out, s_dt,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
    BS: tl.constexpr,
):
    b, h, g, offs_p = head_block(tl.program_id(0), H, heads_per_group, n_pblocks, BP)
    pid_p = tl.program_id(0) % n_pblocks
    odt = y_ptr.dtype.element_ty
    nodes = tl.arange(0, BN)
    ok = nodes < N
    p_ok = offs_p < P
    offs_s = tl.arange(0, BS)
    s_ok = offs_s < S
    x_ch = h * P + offs_p
    b_ch = H * P + g * S + offs_s
    c_ch = b_ch + G * S
    xbc_b = xbc_ptr + b * s_xbc[0]
    cs_b = cs_ptr + b * s_cs[0]

    # Conv + SiLU over every node at once (rounded to the activations' dtype, as the tree kernels store them).
    xh = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, xbc_b, nodes, ok, x_ch, p_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], 0, K, HAS_BIAS, True).to(odt)
    bv = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, xbc_b, nodes, ok, b_ch, s_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], 0, K, HAS_BIAS, True).to(odt)
    cv = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, xbc_b, nodes, ok, c_ch, s_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], 0, K, HAS_BIAS, True).to(odt)
    raw = tl.load(dtr_ptr + b * s_dtr[0] + nodes * s_dtr[1] + h * s_dtr[2], mask=ok, other=0.0).to(tl.float32)
    a = tl.where(ok, softplus_dt(raw + tl.load(dtb_ptr + h).to(tl.float32), dt_lo, dt_hi, CLAMP), 0.0)

    A = tl.load(A_ptr + h).to(tl.float32)
    dskip = tl.load(D_ptr + h).to(tl.float32)
    ps_ok = p_ok[:, None] & s_ok[None, :]
    state = tl.load(h0_ptr + b * s_h0[0] + h * s_h0[1] + offs_p[:, None] * s_h0[2] + offs_s[None, :] * s_h0[3],
                    mask=ps_ok, other=0.0).to(tl.float32)
    xf, bf, cf = xh.to(tl.float32), bv.to(tl.float32), cv.to(tl.float32)
    y = tl.zeros([BN, BP], dtype=tl.float32)
    for t in range(0, N):
        x_t = _row(xf, nodes, t)
        dt_t = tl.sum(tl.where(nodes == t, a, 0.0), 0)
        state = tl.exp(dt_t * A) * state + (dt_t * x_t)[:, None] * _row(bf, nodes, t)[None, :]
        y_t = tl.sum(state * _row(cf, nodes, t)[None, :], 1) + dskip * x_t
        y = tl.where((nodes == t)[:, None], y_t[None, :], y)

    xp_ok = ok[:, None] & p_ok[None, :]
    tl.store(y_ptr + b * s_y[0] + nodes[:, None] * s_y[1] + h * s_y[2] + offs_p[None, :] * s_y[3],
             y.to(odt), mask=xp_ok)
    out_b = out_ptr + b * s_out[0] + nodes[:, None] * s_out[1]
    tl.store(out_b + x_ch[None, :] * s_out[2], xh.to(out_ptr.dtype.element_ty), mask=xp_ok)
    if pid_p == 0:
        tl.store(dt_ptr + b * s_dt[0] + nodes * s_dt[1] + h * s_dt[2], a, mask=ok)
        if h % heads_per_group == 0:  # the group's first head stores its B and C activations
            xs_ok = ok[:, None] & s_ok[None, :]
            tl.store(out_b + b_ch[None, :] * s_out[2], bv.to(out_ptr.dtype.element_ty), mask=xs_ok)
            tl.store(out_b + c_ch[None, :] * s_out[2], cv.to(out_ptr.dtype.element_ty), mask=xs_ok)


def chain_fits(n: int, d_state: int, conv_width: int) -> bool:
    """Whether the recurrence takes a chain of ``n`` nodes (see ``CHAIN_MAX_NODES``, ``CHAIN_MAX_STATE``)."""
    return 1 <= n <= CHAIN_MAX_NODES and d_state <= CHAIN_MAX_STATE and conv_width >= 2


def chain_conv_scan_triton(xBC, conv_state, conv_w, conv_b, dt_raw, dt_bias, dt_limit, A, D, ngroups, headdim,
                           ssm_state, out, *, block_p=None, num_warps=None):
    """``tree_conv_scan_ref`` on chains, written into ``out = (y, xbc, dt)``; both states are read only.

    The caller (``tree_conv_scan_triton``) has checked the shapes and that ``chain_fits``. ``block_p``
    (headdim channels per program) and ``num_warps`` tune the tile.
    """
    b, n, c = xBC.shape
    _, h, p, s = ssm_state.shape
    y, xbc, dt = out
    half = xBC.dtype in (torch.float16, torch.bfloat16)
    bp = min(block_p or (32 if half else 16), triton.next_power_of_2(p))
    n_pblocks = triton.cdiv(p, bp)
    lo, hi = dt_limit
    _chain_conv_scan_kernel[(b * h * n_pblocks,)](
        xBC, conv_state, conv_w, conv_b if conv_b is not None else conv_w, dt_raw, dt_bias, A, D, ssm_state,
        y, xbc, dt,
        n, h, p, s, ngroups, h // ngroups, n_pblocks, float(lo), float(min(hi, 3.0e38)),
        *(t.stride() for t in (xBC, conv_state, conv_w, dt_raw, ssm_state, y, xbc, dt)),
        K=conv_w.shape[1], HAS_BIAS=conv_b is not None, CLAMP=lo > 0.0 or hi < float("inf"),
        BN=max(16, triton.next_power_of_2(n)), BP=bp, BS=max(16, triton.next_power_of_2(s)),
        num_warps=num_warps or 4,
    )
    return y, xbc, dt
