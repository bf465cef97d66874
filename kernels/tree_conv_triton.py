"""Tree conv1d in one Triton launch: each node's depthwise causal conv over its own ancestors, then SiLU.

Tap k of node i is its k-th ancestor, found by walking ``parents`` in-kernel; taps above the root
read the committed conv state. Also serves prefill (``is_chain``: ``parents[i] = i - 1``).
Reference: ``tree_conv1d_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.recurrence_triton import conv_finish, conv_tap, softplus_dt
from stree.kernels.tree_scan_triton import small_tree_ranges

MIN_PROGRAMS = 128
"""Channel blocks halve (128 down to 32) until a launch has this many programs (``conv_tile_setting``)."""


@triton.jit
def _ancestor(cur, par_b, row_ok, s_pn, IS_CHAIN: tl.constexpr):
    """One step up: a tree node's parent, the root's -1, and -m (the m-th most recent committed input) to -m-1."""
    if IS_CHAIN:
        return cur - 1
    up = tl.load(par_b + cur * s_pn, mask=row_ok & (cur > 0), other=0).to(tl.int32)
    return tl.where(cur > 0, tl.minimum(tl.maximum(up, -1), cur - 1), cur - 1)


@triton.jit
def tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, par_b, rows, row_ok, ch, ch_ok,
                   s_xn, s_xc, s_sc, s_sk, s_wc, s_wk, s_pn,
                   K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_CHAIN: tl.constexpr):
    """``silu(conv)`` in fp32 of channels ``ch`` of the tree nodes ``rows`` of one sequence (``xbc_b``,
    ``cs_b``, ``par_b`` point at it), zero outside ``row_ok x ch_ok``. Taps oldest first, as the decode step
    takes them (``recurrence_triton.conv_tap``): tap j is the node's (K-1-j)-th ancestor, or a committed input."""
    ok = row_ok[:, None] & ch_ok[None, :]
    acc = tl.zeros([rows.shape[0], ch.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        # cur >= 0: a tree node; cur == -m: the m-th most recent committed input (state column K-1-m).
        cur = rows
        for _ in tl.static_range(K - 1 - j):
            cur = _ancestor(cur, par_b, row_ok, s_pn, IS_CHAIN)
        in_tree = cur >= 0
        v_tree = tl.load(xbc_b + cur[:, None] * s_xn + ch[None, :] * s_xc, mask=ok & in_tree[:, None], other=0.0)
        col = K - 1 + cur
        v_state = tl.load(cs_b + ch[None, :] * s_sc + col[:, None] * s_sk,
                          mask=ok & (~in_tree & (col >= 0))[:, None], other=0.0)
        wj = tl.load(w_ptr + ch * s_wc + j * s_wk, mask=ch_ok, other=0.0)
        acc = conv_tap(acc, tl.where(in_tree[:, None], v_tree.to(tl.float32), v_state.to(tl.float32)), wj[None, :])
    bias = tl.load(bias_ptr + ch, mask=ch_ok, other=0.0)[None, :] if HAS_BIAS else 0.0
    acc = conv_finish(acc, bias, HAS_BIAS, True)
    return tl.where(ok, acc, 0.0)


@triton.jit
def conv_tiles(xbc_ptr, cs_ptr, w_ptr, bias_ptr, par_b, out_ptr, b, nodes, ok, x_ch, p_ok, b_ch, c_ch, s_ok,
               s_xbc, s_cs, s_w, s_pn, K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_CHAIN: tl.constexpr):
    """``(x, B, C)``: conv + SiLU of a fused tree conv + scan program's channels over every node of sequence ``b``,
    rounded to the stored activations' dtype (``out_ptr``'s), zero on padded nodes and channels."""
    xbc_b = xbc_ptr + b * s_xbc[0]
    cs_b = cs_ptr + b * s_cs[0]
    odt = out_ptr.dtype.element_ty
    xh = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, par_b, nodes, ok, x_ch, p_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], s_pn, K, HAS_BIAS, IS_CHAIN).to(odt)
    bv = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, par_b, nodes, ok, b_ch, s_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], s_pn, K, HAS_BIAS, IS_CHAIN).to(odt)
    cv = tree_conv_tile(xbc_b, cs_b, w_ptr, bias_ptr, par_b, nodes, ok, c_ch, s_ok, s_xbc[1], s_xbc[2],
                        s_cs[1], s_cs[2], s_w[0], s_w[1], s_pn, K, HAS_BIAS, IS_CHAIN).to(odt)
    return xh, bv, cv


@triton.jit
def conv_scan_program(N, H, P, S, G, heads_per_group, BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr):
    """Where a fused tree conv + scan program (grid: sequence x head, headdim block) works: ``(b, h, pid_p, nodes,
    ok, offs_p, p_ok, offs_s, s_ok, x_ch, b_ch, c_ch)``, the last three its x, B and C channels in ``xBC``."""
    bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // heads_per_group
    nodes, ok, offs_p, p_ok, offs_s, s_ok = small_tree_ranges(pid_p, N, P, S, BN, BP, BS)
    x_ch = h * P + offs_p
    b_ch = H * P + g * S + offs_s
    return b, h, pid_p, nodes, ok, offs_p, p_ok, offs_s, s_ok, x_ch, b_ch, b_ch + G * S


@triton.jit
def store_tree_acts(out_ptr, dt_ptr, pre_ptr, xbc_b, b, h, pid_p, heads_per_group, nodes, ok, x_ch, p_ok, b_ch, c_ch,
                    s_ok, xh, bv, cv, a, s_xbc, s_out, s_dt, s_pre, HAS_PRE: tl.constexpr):
    """What one fused tree conv + scan program leaves for the commit: its x channels' post-conv values, dt (headdim
    block 0), the group's B and C (its first head), and with ``HAS_PRE`` a copy of the pre-conv inputs (a stacked
    commit replays every layer from one tensor). Nothing is written twice."""
    xp_ok = ok[:, None] & p_ok[None, :]
    out_b = out_ptr + b * s_out[0] + nodes[:, None] * s_out[1]
    tl.store(out_b + x_ch[None, :] * s_out[2], xh.to(out_ptr.dtype.element_ty), mask=xp_ok)
    node_in = xbc_b + nodes[:, None] * s_xbc[1]
    pre_b = pre_ptr + b * s_pre[0] + nodes[:, None] * s_pre[1]
    if HAS_PRE:
        tl.store(pre_b + x_ch[None, :] * s_pre[2], tl.load(node_in + x_ch[None, :] * s_xbc[2], mask=xp_ok), mask=xp_ok)
    if pid_p == 0:
        tl.store(dt_ptr + b * s_dt[0] + nodes * s_dt[1] + h * s_dt[2], a, mask=ok)
        if h % heads_per_group == 0:
            xs_ok = ok[:, None] & s_ok[None, :]
            tl.store(out_b + b_ch[None, :] * s_out[2], bv.to(out_ptr.dtype.element_ty), mask=xs_ok)
            tl.store(out_b + c_ch[None, :] * s_out[2], cv.to(out_ptr.dtype.element_ty), mask=xs_ok)
            if HAS_PRE:
                tl.store(pre_b + b_ch[None, :] * s_pre[2], tl.load(node_in + b_ch[None, :] * s_xbc[2], mask=xs_ok),
                         mask=xs_ok)
                tl.store(pre_b + c_ch[None, :] * s_pre[2], tl.load(node_in + c_ch[None, :] * s_xbc[2], mask=xs_ok),
                         mask=xs_ok)


@triton.jit
def _tree_conv_kernel(
    xbc_ptr, cs_ptr, w_ptr, bias_ptr, par_ptr, out_ptr,
    N, C,
    s_xb, s_xn, s_xc,
    s_sb, s_sc, s_sk,
    s_wc, s_wk,
    s_pb, s_pn,
    s_ob, s_on, s_oc,
    dtr_ptr, dtb_ptr, dt_ptr, H, s_rb, s_rn, s_rh, s_tb, s_tn, s_th, dt_lo, dt_hi,
    pre_ptr, s_qb, s_qn, s_qc, n_cblocks,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_CHAIN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_DT: tl.constexpr, CLAMP: tl.constexpr, BLOCK_H: tl.constexpr, HAS_PRE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if pid_c < n_cblocks:
        ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        ch_ok = ch < C
        ok = row_ok[:, None] & ch_ok[None, :]
        out = tree_conv_tile(xbc_ptr + b * s_xb, cs_ptr + b * s_sb, w_ptr, bias_ptr, par_ptr + b * s_pb, rows,
                             row_ok, ch, ch_ok, s_xn, s_xc, s_sc, s_sk, s_wc, s_wk, s_pn, K, HAS_BIAS, IS_CHAIN)
        tl.store(out_ptr + b * s_ob + rows[:, None] * s_on + ch[None, :] * s_oc,
                 out.to(out_ptr.dtype.element_ty), mask=ok)
        if HAS_PRE:  # a copy of the nodes' pre-conv inputs for a stacked commit
            tl.store(pre_ptr + b * s_qb + rows[:, None] * s_qn + ch[None, :] * s_qc,
                     tl.load(xbc_ptr + b * s_xb + rows[:, None] * s_xn + ch[None, :] * s_xc, mask=ok), mask=ok)
    elif HAS_DT:  # the programs past the channel blocks turn these nodes' raw dt into dt, BLOCK_H heads each
        hh = (pid_c - n_cblocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = row_ok[:, None] & (hh < H)[None, :]
        v = tl.load(dtr_ptr + b * s_rb + rows[:, None] * s_rn + hh[None, :] * s_rh, mask=m, other=0.0)
        v = v.to(tl.float32) + tl.load(dtb_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)[None, :]
        v = softplus_dt(v, dt_lo, dt_hi, CLAMP)
        tl.store(dt_ptr + b * s_tb + rows[:, None] * s_tn + hh[None, :] * s_th, v, mask=m)


def conv_tile_setting(n: int, c: int, b: int, block_c=None, num_warps=None) -> tuple[int, int, int]:
    """``(block_n, block_c, num_warps)`` of the tree conv: channel blocks narrow enough that a one-sequence tree
    fills the GPU (at least ``MIN_PROGRAMS`` programs), since every program walks its nodes' ancestors serially."""
    block_n = min(32, max(16, triton.next_power_of_2(n)))
    if block_c is None:
        block_c = 128
        while block_c > 32 and b * triton.cdiv(n, block_n) * triton.cdiv(c, block_c) < MIN_PROGRAMS:
            block_c //= 2
    return block_n, block_c, num_warps or 4


def tree_conv1d_triton(xBC, conv_state, weight, bias, parents, activation="silu", *, out=None, is_chain=False,
                       dt=None, pre=None, block_c=None, num_warps=None):
    """Triton ``tree_conv1d_ref``: ``silu(conv)`` ``[B, N, C]`` in ``xBC``'s dtype; ``conv_state`` is read only.

    ``dt = (dt_raw [B, N, H], dt_bias [H], dt_limit, dt_out [B, N, H] float32)`` also fills ``dt_out``;
    ``pre`` (``[B, N, C]``, optional) receives a copy of ``xBC``. ``block_c``/``num_warps`` override the tile
    (``conv_tile_setting``). The dt work runs in programs of its own, beside the channel blocks.
    """
    if activation not in ("silu", "swish"):
        raise ValueError(f"tree_conv1d kernel: activation {activation!r} is not fused (only silu)")
    if xBC.dim() != 3:
        raise ValueError(f"tree_conv1d: xBC must be [B, N, C], got {tuple(xBC.shape)}")
    b, n, c = xBC.shape
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"tree_conv1d: weight {tuple(weight.shape)} must be [{c}, K]")
    width = weight.shape[1]
    if conv_state.shape != (b, c, width - 1):
        raise ValueError(f"tree_conv1d: conv_state {tuple(conv_state.shape)} must be [{b}, {c}, {width - 1}]")
    if not is_chain and parents.shape != (b, n):
        raise ValueError(f"tree_conv1d: parents {tuple(parents.shape)} must be [{b}, {n}]")
    out = torch.empty_like(xBC) if out is None else out
    if out.shape != xBC.shape or (pre is not None and pre.shape != xBC.shape):
        raise ValueError(f"tree_conv1d: out {tuple(out.shape)} / pre must match xBC {tuple(xBC.shape)}")
    block_n, block_c, warps = conv_tile_setting(n, c, b, block_c, num_warps)
    par_strides = parents.stride() if parents is not None and parents.dim() == 2 else (0, 0)
    if dt is not None:
        dt_raw, dt_bias, (lo, hi), dt_out = dt
        h = dt_raw.shape[-1]
        if dt_raw.shape != (b, n, h) or dt_out.shape != (b, n, h) or dt_bias.shape != (h,):
            raise ValueError(f"tree_conv1d: dt_raw {tuple(dt_raw.shape)} / dt_out {tuple(dt_out.shape)} / "
                             f"dt_bias {tuple(dt_bias.shape)} must be [{b}, {n}, H] / [{b}, {n}, H] / [H]")
        dt_args = (dt_raw, dt_bias, dt_out, h, *dt_raw.stride(), *dt_out.stride(), float(lo), float(min(hi, 3.0e38)))
        clamp = lo > 0.0 or hi < float("inf")
    else:
        dt_args, clamp, h = (xBC, xBC, xBC, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0), False, 1
    n_cblocks, block_h = triton.cdiv(c, block_c), min(64, triton.next_power_of_2(h))
    grid = (triton.cdiv(n, block_n), n_cblocks + (triton.cdiv(h, block_h) if dt is not None else 0), b)
    _tree_conv_kernel[grid](
        xBC, conv_state, weight, bias if bias is not None else weight, parents if parents is not None else xBC, out,
        n, c, *xBC.stride(), *conv_state.stride(), *weight.stride(), *par_strides, *out.stride(), *dt_args,
        pre if pre is not None else out, *(pre if pre is not None else out).stride(), n_cblocks,
        K=width, HAS_BIAS=bias is not None, IS_CHAIN=is_chain, BLOCK_N=block_n, BLOCK_C=block_c,
        HAS_DT=dt is not None, CLAMP=clamp, BLOCK_H=block_h, HAS_PRE=pre is not None,
        num_warps=warps, enable_fp_fusion=False,
        **pdl.launch_args(),
    )
    return out


def tree_conv_dt_triton(xBC, conv_state, weight, bias, parents, dt_raw, dt_bias, dt_limit=(0.0, float("inf")),
                        activation="silu"):
    """Triton ``tree_conv_dt_ref``: the tree conv and the nodes' dt in one launch."""
    dt = torch.empty(dt_raw.shape, device=dt_raw.device, dtype=torch.float32)
    out = tree_conv1d_triton(xBC, conv_state, weight, bias, parents, activation, dt=(dt_raw, dt_bias, dt_limit, dt))
    return out, dt
