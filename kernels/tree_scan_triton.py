"""Tree scan in one Triton launch per layer: tree-masked SSD for every node of a padded tree batch.

``y_i = exp(S_i) C_i^T H_0 + sum_{j in anc(i)} exp(S_i - S_j) (C_i . B_j) dt_j x_j + D x_i`` with
three tensor-core products (C H_0^T, C B^T, W X) accumulated in fp32. The ancestor mask and the tree
cumulative sum ``S = mask . (dt A)`` come from ``parents`` inside the kernel (no per-step precompute).
Each kernel takes a tensor's strides as one tuple in its dimension order (``s_x[1]``: x's node stride).
Trees of up to 64 nodes: one program per (sequence, head, headdim block) holds the whole tree and
builds the mask by boolean squaring. Larger trees (up to ``MAX_NODES``): programs own a block of
nodes, loop over column blocks of earlier nodes, and walk parents for the mask. Reference: ``tree_scan_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter

MAX_NODES = 1024
"""Largest padded tree the kernel accepts (= ``protocols.token_tree.MAX_TREE_NODES``); tuned for <= 256."""


@triton.jit
def _walk_sums(par_row_ptr, dt_col_ptr, stride_pn, stride_dtn, nodes, A_h):
    """Tree cumulative sum ``S`` of ``dt * A`` for each of ``nodes`` (-1 = none) by walking to the root."""
    cur = nodes
    acc = tl.zeros(nodes.shape, dtype=tl.float32)
    while tl.max(cur, 0) >= 0:
        live = cur >= 0
        acc += tl.load(dt_col_ptr + cur * stride_dtn, mask=live, other=0.0).to(tl.float32) * A_h
        up = tl.load(par_row_ptr + cur * stride_pn, mask=live, other=-1).to(tl.int32)
        cur = tl.where(live & (up < cur), up, -1)  # parents must come earlier; anything else ends the walk
    return acc


@triton.jit
def _chain_sums(dt_col_ptr, stride_dtn, rows, n_nodes, A_h, BN: tl.constexpr):
    """``S_i = sum_{j <= i} dt_j A`` for a chain (``parents[i] = i - 1``)."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    hi = tl.minimum(tl.max(rows, 0) + 1, n_nodes)
    for c0 in range(0, hi, BN):
        cols = c0 + tl.arange(0, BN)
        a = tl.load(dt_col_ptr + cols * stride_dtn, mask=cols < n_nodes, other=0.0).to(tl.float32) * A_h
        acc += tl.sum(tl.where(cols[None, :] <= rows[:, None], a[None, :], 0.0), 1)
    return acc


@triton.jit
def small_tree_ranges(pid_p, N, P, S, BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr):
    """``(nodes, ok, offs_p, p_ok, offs_s, s_ok)`` of a whole-tree program owning headdim block ``pid_p``."""
    nodes = tl.arange(0, BN)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_s = tl.arange(0, BS)
    return nodes, nodes < N, offs_p, offs_p < P, offs_s, offs_s < S


@triton.jit
def small_tree_mask(par_b, s_pn, nodes, ok, LOG2_BN: tl.constexpr, IS_CHAIN: tl.constexpr):
    """``[BN, BN]`` ancestor-or-self mask of one whole tree (``par_b``: its parents row).

    Reachability closure of (I + parent edges) by LOG2_BN boolean squarings on the tensor cores
    (paths of up to 2^k edges after k squarings), so depth costs nothing extra.
    """
    if IS_CHAIN:
        anc = (nodes[None, :] <= nodes[:, None]) & ok[:, None]
    else:
        par = tl.load(par_b + nodes * s_pn, mask=ok, other=-1).to(tl.int32)
        par = tl.where(par < nodes, par, -1)  # a parent must come earlier
        anc = ((par[:, None] == nodes[None, :]) | (nodes[:, None] == nodes[None, :])) & ok[:, None]
        for _ in tl.static_range(LOG2_BN):
            r = anc.to(tl.float16)
            anc = tl.dot(r, r) > 0.5
    return anc


@triton.jit
def c_dot_bt(c, bt, HALF: tl.constexpr):
    """``C B^T`` of the whole tree: native half products for half inputs, exact fp32 products for fp32."""
    if HALF:
        cb = tl.dot(c, bt)
    else:
        cb = tl.dot(c, bt, input_precision="ieee")
    return cb


@triton.jit
def small_tree_head(anc, cb, c32, a, xh, A_ptr, D_ptr, h0_b, s_h0, h, offs_p, p_ok, offs_s, s_ok,
                    HALF: tl.constexpr):
    """``y`` ``[BN, BP]`` (fp32) of head ``h`` over a whole tree: ``anc`` its mask, ``cb`` = C B^T,
    ``c32`` = C in fp32, ``a`` = dt (zero on padded nodes), ``xh`` = x; ``h0_b`` points at this sequence's state."""
    PREC: tl.constexpr = "tf32" if HALF else "ieee"
    la = a * tl.load(A_ptr + h).to(tl.float32)
    cs = tl.sum(tl.where(anc, la[None, :], 0.0), 1)  # tree cumulative sum S
    h0t = tl.load(h0_b + h * s_h0[1] + offs_p[None, :] * s_h0[2] + offs_s[:, None] * s_h0[3],
                  mask=p_ok[None, :] & s_ok[:, None], other=0.0).to(tl.float32)
    acc = tl.dot(c32, h0t, input_precision=PREC) * tl.exp(cs)[:, None]
    w = tl.exp(tl.where(anc, cs[:, None] - cs[None, :], float("-inf"))) * cb * a[None, :]
    return acc + tl.dot(w, xh, input_precision=PREC) + tl.load(D_ptr + h).to(tl.float32) * xh


@triton.jit
def _tree_scan_small_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, par_ptr, h0_ptr, y_ptr,
    N, H, P, S, heads_per_group, n_hblocks, s_x, s_dt, s_B, s_C, s_par, s_h0, s_y,
    BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, HB: tl.constexpr, LOG2_BN: tl.constexpr,
    IS_CHAIN: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """Whole tree (N <= BN) in one tile; one program serves HB heads of a group and shares the
    ancestor mask and C.B^T between them."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = pid // n_hblocks
    h_first = (pid % n_hblocks) * HB
    g = h_first // heads_per_group
    nodes, ok, offs_p, p_ok, offs_s, s_ok = small_tree_ranges(pid_p, N, P, S, BN, BP, BS)

    anc = small_tree_mask(par_ptr + b * s_par[0], s_par[1], nodes, ok, LOG2_BN, IS_CHAIN)
    c = tl.load(C_ptr + b * s_C[0] + g * s_C[2] + nodes[:, None] * s_C[1] + offs_s[None, :] * s_C[3],
                mask=ok[:, None] & s_ok[None, :], other=0.0)
    bt = tl.load(B_ptr + b * s_B[0] + g * s_B[2] + nodes[None, :] * s_B[1] + offs_s[:, None] * s_B[3],
                 mask=ok[None, :] & s_ok[:, None], other=0.0)
    cb = c_dot_bt(c, bt, HALF)
    c32 = c.to(tl.float32)

    for hh in range(HB):
        h = h_first + hh
        a = tl.load(dt_ptr + b * s_dt[0] + h * s_dt[2] + nodes * s_dt[1], mask=ok, other=0.0).to(tl.float32)
        xh = tl.load(x_ptr + b * s_x[0] + h * s_x[2] + nodes[:, None] * s_x[1] + offs_p[None, :] * s_x[3],
                     mask=ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
        acc = small_tree_head(anc, cb, c32, a, xh, A_ptr, D_ptr, h0_ptr + b * s_h0[0], s_h0, h, offs_p, p_ok,
                              offs_s, s_ok, HALF)
        tl.store(y_ptr + b * s_y[0] + h * s_y[2] + nodes[:, None] * s_y[1] + offs_p[None, :] * s_y[3],
                 acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & p_ok[None, :])


@triton.jit
def _tree_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, par_ptr, h0_ptr, y_ptr,
    N, H, P, S, heads_per_group, s_x, s_dt, s_B, s_C, s_par, s_h0, s_y,
    BM: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
    IS_CHAIN: tl.constexpr, HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    # fp32 inputs: exact fp32 products; half inputs: native products for C.B, tf32 where an operand is fp32.
    PREC: tl.constexpr = "tf32" if HALF else "ieee"

    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < N
    offs_p = pid_p * BP + tl.arange(0, BP)
    p_ok = offs_p < P
    A_h = tl.load(A_ptr + h).to(tl.float32)

    x_b = x_ptr + b * s_x[0] + h * s_x[2]
    dt_b = dt_ptr + b * s_dt[0] + h * s_dt[2]
    B_b = B_ptr + b * s_B[0] + g * s_B[2]
    C_b = C_ptr + b * s_C[0] + g * s_C[2]
    par_b = par_ptr + b * s_par[0]
    h0_b = h0_ptr + b * s_h0[0] + h * s_h0[1]

    if IS_CHAIN:
        S_rows = _chain_sums(dt_b, s_dt[1], rows, N, A_h, BN)
    else:
        S_rows = _walk_sums(par_b, dt_b, s_par[1], s_dt[1], tl.where(row_ok, rows, -1), A_h)

    # Committed-state term: exp(S_i) * C_i . H_0[p, :]
    acc = tl.zeros([BM, BP], dtype=tl.float32)
    for s0 in range(0, S, BS):
        offs_s = s0 + tl.arange(0, BS)
        s_ok = offs_s < S
        c = tl.load(C_b + rows[:, None] * s_C[1] + offs_s[None, :] * s_C[3],
                    mask=row_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
        h0t = tl.load(h0_b + offs_p[None, :] * s_h0[2] + offs_s[:, None] * s_h0[3],
                      mask=p_ok[None, :] & s_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(c, h0t, input_precision=PREC)
    acc = acc * tl.exp(S_rows)[:, None]

    # Tree term over column blocks of earlier-or-equal nodes (ancestors have smaller indices).
    n_cols = tl.minimum(N, (pid_m + 1) * BM)
    running = tl.sum(tl.zeros([BN], dtype=tl.float32), 0)
    for c0 in range(0, n_cols, BN):
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < n_cols
        a_c = tl.load(dt_b + cols * s_dt[1], mask=col_ok, other=0.0).to(tl.float32)
        if IS_CHAIN:
            S_cols = running + tl.cumsum(a_c * A_h, 0)
            running += tl.sum(a_c * A_h, 0)
            anc = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        else:
            S_cols = _walk_sums(par_b, dt_b, s_par[1], s_dt[1], tl.where(col_ok, cols, -1), A_h)
            # Ancestor mask of (rows, cols): walk each row up until it leaves this column block.
            anc = tl.zeros([BM, BN], dtype=tl.int1)
            cur = tl.where(row_ok, rows, -1)
            while tl.max(cur, 0) >= c0:
                anc = anc | (cur[:, None] == cols[None, :])
                up = tl.load(par_b + cur * s_par[1], mask=cur >= 0, other=-1).to(tl.int32)
                cur = tl.where((cur >= 0) & (up < cur), up, -1)
        cb = tl.zeros([BM, BN], dtype=tl.float32)
        for s0 in range(0, S, BS):
            offs_s = s0 + tl.arange(0, BS)
            s_ok = offs_s < S
            c = tl.load(C_b + rows[:, None] * s_C[1] + offs_s[None, :] * s_C[3],
                        mask=row_ok[:, None] & s_ok[None, :], other=0.0)
            bt = tl.load(B_b + cols[None, :] * s_B[1] + offs_s[:, None] * s_B[3],
                         mask=col_ok[None, :] & s_ok[:, None], other=0.0)
            if HALF:
                cb += tl.dot(c, bt)
            else:
                cb += tl.dot(c.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        seg = tl.where(anc, S_rows[:, None] - S_cols[None, :], float("-inf"))
        w = tl.exp(seg) * cb * a_c[None, :]
        xc = tl.load(x_b + cols[:, None] * s_x[1] + offs_p[None, :] * s_x[3],
                     mask=col_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(w, xc, input_precision=PREC)

    x_rows = tl.load(x_b + rows[:, None] * s_x[1] + offs_p[None, :] * s_x[3],
                     mask=row_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
    acc += tl.load(D_ptr + h).to(tl.float32) * x_rows
    tl.store(y_ptr + b * s_y[0] + h * s_y[2] + rows[:, None] * s_y[1] + offs_p[None, :] * s_y[3],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & p_ok[None, :])


SMALL_MAX_NODES = 64
"""Trees up to this many (padded) nodes take the single-tile kernel; larger ones the tiled kernel."""
SMALL_MAX_STATE = 256
"""Largest ``d_state`` the single-tile kernel takes."""


def check_tree_scan_inputs(x, dt, A, Bm, Cm, D, parents, ssm_state) -> None:
    """Shape checks shared by the tree-scan entry points (no device sync)."""
    if x.dim() != 4:
        raise ValueError(f"tree_scan: x must be [B, N, H, P], got {tuple(x.shape)}")
    b, n, h, p = x.shape
    if n > MAX_NODES:
        raise ValueError(f"tree_scan: {n} nodes is over the kernel limit of {MAX_NODES}")
    if dt.shape != (b, n, h) or A.shape != (h,) or D.shape != (h,):
        raise ValueError(f"tree_scan: dt {tuple(dt.shape)}, A {tuple(A.shape)}, D {tuple(D.shape)} "
                         f"do not match x {tuple(x.shape)}")
    if Bm.dim() != 4 or Bm.shape[:2] != (b, n) or Cm.shape != Bm.shape or h % Bm.shape[2]:
        raise ValueError(f"tree_scan: B {tuple(Bm.shape)} / C {tuple(Cm.shape)} must be [B, N, G, S] "
                         f"with G dividing {h} heads")
    if parents.shape != (b, n):
        raise ValueError(f"tree_scan: parents {tuple(parents.shape)} must be [{b}, {n}]")
    if ssm_state.shape != (b, h, p, Bm.shape[3]):
        raise ValueError(f"tree_scan: ssm_state {tuple(ssm_state.shape)} must be [{b}, {h}, {p}, {Bm.shape[3]}]")


def tree_scan_triton(x, dt, A, Bm, Cm, D, parents, ssm_state, *, out=None, is_chain=False,
                     block_m=None, block_p=None, block_s=None, heads_per_program=None, num_warps=None,
                     tile_nodes=None):
    """Triton ``tree_scan_ref``: ``y`` ``[B, N, H, P]`` in ``x``'s dtype; ``ssm_state`` is read only.

    ``is_chain=True`` treats every tree as the chain ``parents[i] = i - 1`` (``parents`` unused),
    which prefill uses. ``out`` (optional) receives ``y``. Trees of up to ``SMALL_MAX_NODES`` nodes
    run in the single-tile kernel unless ``block_m`` asks for a smaller node tile; the other
    keywords override the tiling (see ``stree bench kernels --sweep``). ``tile_nodes`` pins the single tile's node
    count (at least ``n``), so every shorter input is computed in the same tile (the exact numerics' prefill).
    """
    check_tree_scan_inputs(x, dt, A, Bm, Cm, D, parents, ssm_state)
    b, n, h, p = x.shape
    s = Bm.shape[3]
    hpg = h // Bm.shape[2]
    y = torch.empty_like(x) if out is None else out
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"tree_scan: out {tuple(y.shape)} {y.dtype} must match x {tuple(x.shape)} {x.dtype}")
    half = x.dtype in (torch.float16, torch.bfloat16)
    bn = max(16, triton.next_power_of_2(n), tile_nodes or 0)
    bp = block_p or min(32, max(16, triton.next_power_of_2(p)))
    common = (x, dt, A, Bm, Cm, D, parents, ssm_state, y)
    strides = tuple(t.stride() for t in (x, dt, Bm, Cm, parents, ssm_state, y))
    if n <= SMALL_MAX_NODES and s <= SMALL_MAX_STATE and (block_m is None or block_m >= bn):
        hb = heads_per_program or 1  # sharing the mask and C.B^T between heads measured slower
        if hpg % hb:
            raise ValueError(f"tree_scan: heads_per_program={hb} must divide the {hpg} heads of a group")
        bs = max(16, triton.next_power_of_2(s))
        grid = (b * (h // hb), triton.cdiv(p, bp))
        _tree_scan_small_kernel[grid](
            *common, n, h, p, s, hpg, h // hb, *strides,
            BN=bn, BP=bp, BS=bs, HB=hb, LOG2_BN=bn.bit_length() - 1, IS_CHAIN=is_chain, HALF=half,
            num_warps=num_warps or 4,
            **pdl.launch_args(),
        )
        return y
    bm = block_m or 64
    bs = block_s or min(128, max(16, triton.next_power_of_2(s)))
    grid = (b * h, triton.cdiv(p, bp), triton.cdiv(n, bm))
    _tree_scan_kernel[grid](
        *common, n, h, p, s, hpg, *strides,
        BM=bm, BN=bm, BP=bp, BS=bs, IS_CHAIN=is_chain, HALF=half, num_warps=num_warps or 4,
        **pdl.launch_args(),
    )
    return y
