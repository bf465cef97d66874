"""The exact numerics' tree pass of a Mamba2 layer in Triton: the tree conv, then every node's state walked along
its path with the decode step's own arithmetic (reference: ``ssm_walk.tree_conv_scan_exact_ref``).

Two launches. The tree conv (``tree_conv_triton``, taps oldest first as the step takes them) writes every node's
post-conv x, B, C and dt, which the commit replays anyway. Then ``_tree_walk_kernel``: one program per (sequence,
head, headdim block[, group of nodes]) loads the committed state tile once and, for each of its nodes, steps a state
along the node's root-to-node path with ``recurrence_triton.ssm_update`` (the step's ``exp(dt A) H + (dt x) B^T``,
rounded to the state's dtype after every step as a stored state is) and writes ``y = ssm_output(H, C, D, x)`` on a
tile of the decode step's shape (``walk_tile``, the whole d_state). No cumulative sums of ``dt A`` and no products
of decays: a node's output is what one-token decode steps along its path give, bit for bit.

A chain (``is_chain``) is one loop of one step per node, its loads pipelined. A tree is walked in depth-first
preorder (``preorder``, computed in registers from the parents): a node's walk starts from the deepest state the
program still holds, the previous node's or that node's parent's, so most nodes cost one step, and a node after a
finished subtree walks down from the nearest held ancestor or the committed state. Where few programs would run
(small batches), a tree's preorder is split over more programs, which changes no bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.decode_step_triton import head_block
from stree.kernels.gemm_triton import _sms
from stree.kernels.pdl import pdl_enter
from stree.kernels.recurrence_triton import carry, ssm_output, ssm_update, state_block, walk_tile
from stree.kernels.tree_conv_triton import tree_conv1d_triton


@triton.jit(do_not_specialize=["N", "per_program"])
def _tree_walk_kernel(
    xbc_ptr, dt_ptr, par_ptr, A_ptr, D_ptr, h0_ptr, y_ptr,
    N, H, P, S, G, heads_per_group, n_pblocks, per_program,
    s_xb, s_xn, s_xc, s_db, s_dn, s_dh, s_pb, s_pn, s_hb, s_hh, s_hp, s_hs, s_yb, s_yn, s_yh, s_yp,
    NP: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, D_PER_CHANNEL: tl.constexpr, IS_CHAIN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b, h, g, offs_p = head_block(tl.program_id(0), H, heads_per_group, n_pblocks, BP)
    lo = tl.program_id(1) * per_program
    hi = tl.minimum(N, lo + per_program)
    p_ok = offs_p < P
    offs_s = tl.arange(0, BS)
    s_ok = offs_s < S
    st_mask = p_ok[:, None] & s_ok[None, :]
    h0 = tl.load(h0_ptr + b * s_hb + h * s_hh + offs_p[:, None] * s_hp + offs_s[None, :] * s_hs, mask=st_mask,
                 other=0.0).to(tl.float32)
    sdt = h0_ptr.dtype.element_ty
    a_h = tl.load(A_ptr + h).to(tl.float32)
    x_ch = h * P + offs_p
    if D_PER_CHANNEL:
        dskip = tl.load(D_ptr + x_ch, mask=p_ok, other=0.0).to(tl.float32)
    else:
        dskip = tl.load(D_ptr + h).to(tl.float32)
    x_b = xbc_ptr + b * s_xb + x_ch * s_xc
    b_b = xbc_ptr + b * s_xb + (H * P + g * S + offs_s) * s_xc
    c_b = b_b + G * S * s_xc
    dt_b = dt_ptr + b * s_db + h * s_dh
    par_b = par_ptr + b * s_pb
    y_b = y_ptr + b * s_yb + h * s_yh + offs_p * s_yp
    if IS_CHAIN:  # node i's parent is node i - 1: one step per node from the root, outputs from node lo on
        state = h0
        for i in tl.range(0, hi, num_stages=2):
            x = tl.load(x_b + i * s_xn, mask=p_ok, other=0.0).to(tl.float32)
            bv = tl.load(b_b + i * s_xn, mask=s_ok, other=0.0).to(tl.float32)
            cv = tl.load(c_b + i * s_xn, mask=s_ok, other=0.0).to(tl.float32)
            new = ssm_update(state, tl.load(dt_b + i * s_dn), a_h, x, bv)
            tl.store(y_b + i * s_yn, ssm_output(new, cv, dskip, x).to(y_ptr.dtype.element_ty),
                     mask=p_ok & (offs_p * 0 + i >= lo))
            state = carry(new, sdt)
    else:
        _walk_tree(lo, hi, N, h0, x_b, b_b, c_b, dt_b, par_b, y_b, a_h, dskip, p_ok, s_ok, s_xn, s_dn, s_pn, s_yn,
                   sdt, NP, BP)


@triton.jit
def preorder(par, ok, idx, N):
    """``order[p]``: the node at position ``p`` of the depth-first preorder of the forest ``par`` describes (parents
    in registers, ``-1`` for a root; children and roots in node order), over the real nodes ``ok``. One node after
    another: a node's first child comes next, else the next sibling of the node or of its nearest ancestor that has
    one. Only ``[NP]`` vectors, so the walk keeps its registers."""
    none = 1 << 30  # no such node
    order = idx * 0
    v = N * 0  # node 0 is the first root
    for p in range(0, N):
        order = tl.where(idx == p, v, order)
        child = tl.min(tl.where((par == v) & ok, idx, none), 0)
        u = v
        nxt = child
        while (nxt == none) & (u >= 0):  # no child (left): the next sibling of u, else climb to its parent
            pu = tl.sum(tl.where(idx == u, par, 0), 0)
            nxt = tl.min(tl.where((par == pu) & (idx > u) & ok, idx, none), 0)
            u = tl.where(nxt == none, pu, u)
        v = nxt
    return order


@triton.jit
def _walk_tree(lo, hi, N, h0, x_b, b_b, c_b, dt_b, par_b, y_b, a_h, dskip, p_ok, s_ok, s_xn, s_dn, s_pn, s_yn,
               STATE_DTYPE: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr):
    """The nodes at positions ``lo .. hi-1`` of the tree's depth-first preorder: each one's state stepped along
    its path from the deepest state held."""
    idx = tl.arange(0, NP)
    node_ok = idx < N
    parents = tl.load(par_b + idx * s_pn, mask=node_ok, other=-1).to(tl.int32)
    parents = tl.where((parents >= 0) & (parents < idx), parents, -1)  # a parent comes before its child
    order = preorder(parents, node_ok, idx, N)
    cur = h0  # the state of node cur_node, and sib that of its parent sib_node (-1: nothing held)
    sib = h0
    cur_node = lo * 0 - 1
    sib_node = lo * 0 - 1
    for k in range(lo, hi):
        i = tl.sum(tl.where(idx == k, order, 0), 0)
        # rev[m] = the m-th ancestor of node i (rev[0] = i), for m <= d, its depth
        rev = tl.full([NP], -1, dtype=tl.int32)
        v = i
        d = i * 0 - 1
        while v >= 0:
            d += 1
            rev = tl.where(idx == d, v, rev)
            v = tl.sum(tl.where(idx == v, parents, 0), 0)  # its parent, from the registers
        on_path = idx <= d
        at_cur = on_path & (rev == cur_node)
        at_sib = on_path & (rev == sib_node)
        state = h0
        start = d * 0
        if tl.sum(at_cur.to(tl.int32), 0) > 0:
            state = cur
            start = d - tl.sum(tl.where(at_cur, idx, 0), 0) + 1
        elif tl.sum(at_sib.to(tl.int32), 0) > 0:
            state = sib
            start = d - tl.sum(tl.where(at_sib, idx, 0), 0) + 1
        for m in range(start, d):  # one decode step per ancestor still to walk, root side first
            node = tl.sum(tl.where(idx == d - m, rev, 0), 0)
            x = tl.load(x_b + node * s_xn, mask=p_ok, other=0.0).to(tl.float32)
            bv = tl.load(b_b + node * s_xn, mask=s_ok, other=0.0).to(tl.float32)
            state = carry(ssm_update(state, tl.load(dt_b + node * s_dn), a_h, x, bv), STATE_DTYPE)
        # node i's own step, outside the loop: every value the outer loop carries is then a new one, which
        # Triton's front end needs to see a variable as loop-carried (a plain copy of a carried value is not)
        x = tl.load(x_b + i * s_xn, mask=p_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_b + i * s_xn, mask=s_ok, other=0.0).to(tl.float32)
        new = ssm_update(state, tl.load(dt_b + i * s_dn), a_h, x, bv)
        cv = tl.load(c_b + i * s_xn, mask=s_ok, other=0.0).to(tl.float32)
        tl.store(y_b + i * s_yn, ssm_output(new, cv, dskip, x).to(y_b.dtype.element_ty), mask=p_ok)
        sib = state  # i's parent's state
        sib_node = tl.sum(tl.where(idx == 1, rev, 0), 0)  # i's parent (-1 for the root)
        cur = carry(new, STATE_DTYPE)
        cur_node = i


def tree_walk_triton(xbc, dt, parents, A, D, ssm_state, ngroups: int, *, out=None, is_chain: bool = False,
                     programs_per_tree=None):
    """``y`` ``[B, N, H, P]`` (``xbc``'s dtype) of every node from post-conv ``xbc`` ``[B, N, C]`` and ``dt``
    ``[B, N, H]`` float32 (``ssm_walk.ssm_tree_walk_ref``); ``ssm_state`` is read only. ``D`` is per head ``[H]`` or
    per channel ``[H * P]``. ``programs_per_tree`` (default: enough to fill the GPU; 1 for chains) splits the
    nodes over programs, which changes no bit."""
    b, n, c = xbc.shape
    _, h, p, s = ssm_state.shape
    if c != h * p + 2 * ngroups * s or dt.shape != (b, n, h) or parents.shape != (b, n) or h % ngroups:
        raise ValueError(f"tree_walk: xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, parents {tuple(parents.shape)} "
                         f"do not fit ssm_state {tuple(ssm_state.shape)} with {ngroups} groups")
    if D.numel() not in (h, h * p) or A.shape != (h,):
        raise ValueError(f"tree_walk: A {tuple(A.shape)} must be [{h}] and D ({D.numel()}) have {h} or {h * p} "
                         "entries")
    y = torch.empty(b, n, h, p, device=xbc.device, dtype=xbc.dtype) if out is None else out
    if b == 0 or n == 0:
        return y
    bp, warps = walk_tile(p)
    n_pblocks = triton.cdiv(p, bp)
    items = b * h * n_pblocks
    if programs_per_tree is None:
        programs_per_tree = 1 if is_chain else max(1, min(n, triton.cdiv(2 * _sms(xbc.device), items)))
    per_program = triton.cdiv(n, programs_per_tree)
    _tree_walk_kernel[(items, triton.cdiv(n, per_program))](
        xbc, dt, parents, A, D, ssm_state, y,
        n, h, p, s, ngroups, h // ngroups, n_pblocks, per_program,
        *xbc.stride(), *dt.stride(), *parents.stride(), *ssm_state.stride(), *y.stride(),
        NP=max(2, triton.next_power_of_2(n)), BP=bp, BS=state_block(s),
        D_PER_CHANNEL=D.numel() == h * p and D.numel() != h, IS_CHAIN=is_chain, num_warps=warps,
        enable_fp_fusion=False, **pdl.launch_args(xbc.device),
    )
    return y


def tree_conv_scan_exact_triton(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation,
                                A, D, ngroups, headdim, ssm_state, *, is_chain=False, out=None, pre=None):
    """Triton ``tree_conv_scan_exact_ref``: ``(y, xbc, dt)``; both states are read only. ``out = (y, xbc, dt)``
    (None entries allocated) and ``pre`` (a copy of ``xBC`` for a stacked commit) as ``tree_conv_scan_triton``."""
    b, n, c = xBC.shape
    if ssm_state.dim() != 4 or ssm_state.shape[2] != headdim:
        raise ValueError(f"tree_conv_scan: headdim {headdim} does not match ssm_state {tuple(ssm_state.shape)}")
    y, xbc, dt = out if out is not None else (None, None, None)
    xbc = torch.empty_like(xBC) if xbc is None else xbc
    dt = torch.empty(b, n, dt_raw.shape[-1], device=xBC.device, dtype=torch.float32) if dt is None else dt
    tree_conv1d_triton(xBC, conv_state, conv_w, conv_b, parents, activation, out=xbc,
                       dt=(dt_raw, dt_bias, dt_limit, dt), is_chain=is_chain, pre=pre)
    return tree_walk_triton(xbc, dt, parents, A, D, ssm_state, ngroups, out=y, is_chain=is_chain), xbc, dt
