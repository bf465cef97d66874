"""The tree pass's conv (+SiLU), dt and scan over a CHAIN in one Triton launch (reference: ``tree_conv_scan_ref``).

A chain needs no ancestor mask: the scan is the decode step's recurrence run node after node, so this
kernel keeps a (headdim block x d_state) state tile in registers and updates it once per node, where the
whole-tree kernel (``tree_conv_scan_triton``) builds the mask and two small matrix products. All loads come
first (the conv of every node as one tile, as the tree kernel does), then the sequential part only reads
registers, so its latency is the loads' once, not once per node. One program per (sequence, head, headdim
block); the node count is a compile-time constant (chains are short templates), so the loop unrolls.
"""

from __future__ import annotations

import triton
import triton.language as tl

from stree.kernels import backend, pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.tree_conv_triton import conv_scan_program, conv_tiles, softplus_dt, store_tree_acts

CHAIN_MAX_NODES = 5
"""Longest chain the sequential kernel takes; longer chains run the whole-tree tile kernel, which is faster there
because the sequential part grows with every node (BENCHMARKS.md has the per-length timings)."""


@triton.jit
def _row(tile, sel):
    """Row ``sel`` (a one-hot ``[BN]`` mask) of ``tile`` ``[BN, W]`` as a ``[W]`` vector."""
    return tl.sum(tl.where(sel[:, None], tile, 0.0), 0)


@triton.jit
def _chain_conv_scan_kernel(
    xbc_ptr, cs_ptr, w_ptr, bias_ptr, dtr_ptr, dtb_ptr, A_ptr, D_ptr, h0_ptr,
    y_ptr, out_ptr, dt_ptr, pre_ptr,
    H, P, S, G, heads_per_group, dt_lo, dt_hi,
    s_xbc, s_cs, s_w, s_dtr, s_h0, s_y, s_out, s_dt, s_pre,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, HAS_PRE: tl.constexpr,
    BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b, h, pid_p, nodes, ok, offs_p, p_ok, offs_s, s_ok, x_ch, b_ch, c_ch = conv_scan_program(
        N, H, P, S, G, heads_per_group, BN, BP, BS)
    odt = y_ptr.dtype.element_ty
    # Every load first: the conv + SiLU of this program's channels over the whole chain (rounded to the
    # activations' dtype, as the stored activations are), dt, and the committed state tile.
    xh, bv, cv = conv_tiles(xbc_ptr, cs_ptr, w_ptr, bias_ptr, xbc_ptr, out_ptr, b, nodes, ok, x_ch, p_ok, b_ch, c_ch,
                            s_ok, s_xbc, s_cs, s_w, 0, K, HAS_BIAS, True)
    raw = tl.load(dtr_ptr + b * s_dtr[0] + nodes * s_dtr[1] + h * s_dtr[2], mask=ok, other=0.0).to(tl.float32)
    a = tl.where(ok, softplus_dt(raw + tl.load(dtb_ptr + h).to(tl.float32), dt_lo, dt_hi, CLAMP), 0.0)
    state = tl.load(h0_ptr + b * s_h0[0] + h * s_h0[1] + offs_p[:, None] * s_h0[2] + offs_s[None, :] * s_h0[3],
                    mask=p_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
    a_h = tl.load(A_ptr + h).to(tl.float32)
    d_h = tl.load(D_ptr + h).to(tl.float32)
    x32, b32, c32 = xh.to(tl.float32), bv.to(tl.float32), cv.to(tl.float32)

    # The recurrence, node after node, from registers: h <- exp(dt A) h + dt x B^T, y = h C + D x.
    y_b = y_ptr + b * s_y[0] + h * s_y[2] + offs_p * s_y[3]
    for i in tl.static_range(N):
        sel = nodes == i
        x_i = _row(x32, sel)
        dt_i = tl.sum(tl.where(sel, a, 0.0), 0)
        state = state * tl.exp(dt_i * a_h) + (dt_i * x_i)[:, None] * _row(b32, sel)[None, :]
        y_i = tl.sum(state * _row(c32, sel)[None, :], 1) + d_h * x_i
        tl.store(y_b + i * s_y[1], y_i.to(odt), mask=p_ok)

    store_tree_acts(out_ptr, dt_ptr, pre_ptr, xbc_ptr + b * s_xbc[0], b, h, pid_p, heads_per_group, nodes, ok,
                    x_ch, p_ok, b_ch, c_ch, s_ok, xh, bv, cv, a, s_xbc, s_out, s_dt, s_pre, HAS_PRE)


def launch_chain_conv_scan(xBC, conv_state, conv_w, conv_b, dt_raw, dt_bias, A, D, ssm_state, y, xbc, dt, pre,
                           h, p, s, ngroups, lo, hi, width, half, bp, num_warps):
    """The chain kernel over inputs ``tree_conv_scan_triton`` checked, ``bp`` headdim channels per program."""
    b, n, _ = xBC.shape
    pre_t = pre if pre is not None else xbc
    _chain_conv_scan_kernel[(b * h, triton.cdiv(p, bp))](
        xBC, conv_state, conv_w, conv_b if conv_b is not None else conv_w, dt_raw, dt_bias, A, D, ssm_state,
        y, xbc, dt, pre_t,
        h, p, s, ngroups, h // ngroups, float(lo), float(min(hi, 3.0e38)),
        *(t.stride() for t in (xBC, conv_state, conv_w, dt_raw, ssm_state, y, xbc, dt, pre_t)),
        N=n, K=width, HAS_BIAS=conv_b is not None, CLAMP=lo > 0.0 or hi < float("inf"), HAS_PRE=pre is not None,
        BN=max(2, triton.next_power_of_2(n)), BP=bp, BS=max(16, triton.next_power_of_2(s)),
        num_warps=num_warps or (8 if half else 4), **pdl.launch_args(),
    )
