"""``y = x W^T + b`` for a few rows (decode and tree-pass projections) in one Triton launch, optionally
with the norm before it fused in as a prologue (references: ``F.linear``, ``norm_linear.*_ref``).

Each program owns ``BN`` output columns for every row and streams its slice of ``W`` in ``BK``-wide
chunks, summing FMA products in fp32. Small K (the demo pair) is unrolled so every load is issued
before the first product; large K (the 2.7B shape) loops with software pipelining. The narrow column
block gives hundreds of programs, which is what a weight-streaming few-row GEMM needs. Measured on the
H100 (fp32, demo target, 5 rows) the unrolled form takes 2.5-3.6 us where cuBLAS takes 5.7-6.3 us.

Prologues (``PRO``): 1 is residual add + RMSNorm over the whole row (the block's pre-norm before
``in_proj``; program 0 also writes the new residual), 2 is Mamba2's gated grouped RMSNorm (before
``out_proj``). Every program recomputes the row norms from the few input rows (they sit in L2), which
saves the norm's own launch. ``linear.choose_rows`` / ``norm_linear`` time these against cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from stree.kernels import pdl
from stree.kernels.norms_triton import row_major
from stree.kernels.pdl import pdl_enter

MAX_ROWS = 32
MAX_K = 16384
UNROLL_K = 2048  # up to here the K chunks are unrolled (all loads in flight); beyond, a pipelined loop
_TILE = 16384  # BM * BN * BK elements of products per chunk


@triton.jit
def _rows(ptr, rows, ks, s_m, s_k, mask):
    return tl.load(ptr + rows[:, None] * s_m + ks[None, :] * s_k, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pre_norm(x_ptr, r_ptr, z_ptr, rows, ks, mask, s_xm, s_xk, s_rm, s_zm,
              PRO: tl.constexpr, HAS_RES: tl.constexpr, NBG: tl.constexpr):
    """A chunk of the value the norm sees: x, x + residual (PRO 1), y * silu(z) or y (PRO 2)."""
    v = _rows(x_ptr, rows, ks, s_xm, s_xk, mask)
    if PRO == 1:
        if HAS_RES:
            v += _rows(r_ptr, rows, ks, s_rm, 1, mask)
    if PRO == 2:
        if not NBG:
            z = _rows(z_ptr, rows, ks, s_zm, 1, mask)
            v = v * z * tl.sigmoid(z)
    return v


@triton.jit
def _w_chunk(w_ptr, cols, col_ok, ks, k_ok, s_wn, s_wk):
    """``W[cols, ks]`` (zero outside)."""
    return tl.load(w_ptr + cols[:, None] * s_wn + ks[None, :] * s_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _chunk(acc, rstd, pid, x_ptr, r_ptr, z_ptr, nw_ptr, w, rout_ptr, rows, row_ok, ks, k_ok,
           s_xm, s_xk, s_rm, s_zm, s_om,
           PRO: tl.constexpr, HAS_RES: tl.constexpr, NBG: tl.constexpr):
    """``acc += normed(x)[:, ks] w^T`` for one chunk of K (``w`` = ``W[cols, ks]``)."""
    m2 = row_ok[:, None] & k_ok[None, :]
    v = _pre_norm(x_ptr, r_ptr, z_ptr, rows, ks, m2, s_xm, s_xk, s_rm, s_zm, PRO, HAS_RES, NBG)
    return _chunk_of(acc, v, rstd, pid, x_ptr, z_ptr, nw_ptr, w, rout_ptr, rows, ks, k_ok, m2, s_zm, s_om, PRO, NBG)


@triton.jit
def _chunk_of(acc, v, rstd, pid, x_ptr, z_ptr, nw_ptr, w, rout_ptr, rows, ks, k_ok, m2, s_zm, s_om,
              PRO: tl.constexpr, NBG: tl.constexpr):
    """``_chunk`` on the chunk's pre-norm value ``v``, already loaded."""
    if PRO == 1:
        if pid == 0:
            tl.store(rout_ptr + rows[:, None] * s_om + ks[None, :], v.to(rout_ptr.dtype.element_ty), mask=m2)
    if PRO != 0:
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        h = v * rstd[:, None] * nw[None, :]
        if PRO == 2:
            if NBG:
                z = _rows(z_ptr, rows, ks, s_zm, 1, m2)
                h = h * z * tl.sigmoid(z)
        v = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # the norm's output dtype, as the reference rounds
    return acc + tl.sum(v[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def linear_rows_tile(pid, x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr,
                     M, N, s_xm, s_xk, s_rm, s_zm, s_wn, s_wk, s_ym, s_om, eps,
                     G: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     UNROLL: tl.constexpr, STAGES: tl.constexpr, PRO: tl.constexpr, HAS_RES: tl.constexpr,
                     NBG: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """Output columns ``[pid * BN, (pid + 1) * BN)`` of every row (tile ``pid`` 0 also writes the residual).
    With ``PDL`` the first chunk of ``W`` is loaded before waiting for the kernel before (weights are constant)."""
    cols = pid * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    col_ok = cols < N
    NKG: tl.constexpr = (GS + BK - 1) // BK  # chunks per norm group (the whole K when there is no group)
    first = tl.arange(0, BK)
    w_first = _w_chunk(w_ptr, cols, col_ok, first, first < GS, s_wn, s_wk) if PDL else None
    pdl_enter(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g in tl.static_range(G):
        lo = g * GS
        rstd = tl.zeros([BM], dtype=tl.float32)
        if PRO != 0:  # the group's sum of squares, from the few input rows
            ss = tl.zeros([BM], dtype=tl.float32)
            for kb in tl.static_range(NKG):
                ks = lo + kb * BK + tl.arange(0, BK)
                m2 = row_ok[:, None] & (ks < lo + GS)[None, :]
                v = _pre_norm(x_ptr, r_ptr, z_ptr, rows, ks, m2, s_xm, s_xk, s_rm, s_zm, PRO, HAS_RES, NBG)
                ss += tl.sum(v * v, axis=1)
            rstd = 1.0 / tl.sqrt(ss / GS + eps)
        if UNROLL:
            for kb in tl.static_range(NKG):
                ks = lo + kb * BK + tl.arange(0, BK)
                k_ok = ks < lo + GS
                if PDL and g == 0 and kb == 0:
                    w = w_first
                else:
                    w = _w_chunk(w_ptr, cols, col_ok, ks, k_ok, s_wn, s_wk)
                if PRO != 0 and NKG == 1:  # the group is one chunk: the rows the sum of squares loaded serve again
                    acc = _chunk_of(acc, v, rstd, pid, x_ptr, z_ptr, nw_ptr, w, rout_ptr, rows, ks, k_ok, m2, s_zm,
                                    s_om, PRO, NBG)
                else:
                    acc = _chunk(acc, rstd, pid, x_ptr, r_ptr, z_ptr, nw_ptr, w, rout_ptr, rows, row_ok, ks, k_ok,
                                 s_xm, s_xk, s_rm, s_zm, s_om, PRO, HAS_RES, NBG)
        else:
            if PDL and g == 0:  # the prefetched chunk first, then the pipelined loop over the rest
                ks = lo + tl.arange(0, BK)
                acc = _chunk(acc, rstd, pid, x_ptr, r_ptr, z_ptr, nw_ptr, w_first, rout_ptr, rows, row_ok, ks,
                             ks < lo + GS, s_xm, s_xk, s_rm, s_zm, s_om, PRO, HAS_RES, NBG)
                for kb in tl.range(1, NKG, num_stages=STAGES):
                    ks = lo + kb * BK + tl.arange(0, BK)
                    k_ok = ks < lo + GS
                    acc = _chunk(acc, rstd, pid, x_ptr, r_ptr, z_ptr, nw_ptr,
                                 _w_chunk(w_ptr, cols, col_ok, ks, k_ok, s_wn, s_wk), rout_ptr, rows, row_ok, ks,
                                 k_ok, s_xm, s_xk, s_rm, s_zm, s_om, PRO, HAS_RES, NBG)
            else:
                for kb in tl.range(NKG, num_stages=STAGES):
                    ks = lo + kb * BK + tl.arange(0, BK)
                    k_ok = ks < lo + GS
                    acc = _chunk(acc, rstd, pid, x_ptr, r_ptr, z_ptr, nw_ptr,
                                 _w_chunk(w_ptr, cols, col_ok, ks, k_ok, s_wn, s_wk), rout_ptr, rows, row_ok, ks,
                                 k_ok, s_xm, s_xk, s_rm, s_zm, s_om, PRO, HAS_RES, NBG)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _linear_rows_kernel(x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr,
                        M, N, s_xm, s_xk, s_rm, s_zm, s_wn, s_wk, s_ym, s_om, eps,
                        G: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        UNROLL: tl.constexpr, STAGES: tl.constexpr, PRO: tl.constexpr, HAS_RES: tl.constexpr,
                        NBG: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    linear_rows_tile(tl.program_id(0), x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rout_ptr,
                     M, N, s_xm, s_xk, s_rm, s_zm, s_wn, s_wk, s_ym, s_om, eps,
                     G, GS, BM, BN, BK, UNROLL, STAGES, PRO, HAS_RES, NBG, HAS_BIAS, PDL)


def fits(m: int, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``m`` rows against ``weight`` (few rows, K up to ``MAX_K``)."""
    return 1 <= m <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K


def config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Tile sizes: narrow columns and unrolled K for small K; for large K wider column blocks, a loop."""
    bm = max(2, triton.next_power_of_2(m))
    if k <= UNROLL_K:
        bn = 4
        return dict(block_n=bn, block_k=min(triton.next_power_of_2(k), _TILE // (bm * bn)), unroll=True,
                    num_warps=2 if bm <= 8 else 4, num_stages=1)
    bn = 8 if n >= 4096 else 4
    return dict(block_n=bn, block_k=min(1024, _TILE // (bm * bn)), unroll=False, num_warps=4, num_stages=3)


def _check(x2: torch.Tensor, weight: torch.Tensor, bias) -> None:
    m, k = x2.shape
    n = weight.shape[0]
    if not fits(m, weight) or weight.shape[1] != k:
        raise ValueError(f"linear_rows: x {tuple(x2.shape)} must have 1..{MAX_ROWS} rows of K = weight's "
                         f"{weight.shape[1]} <= {MAX_K} (weight {tuple(weight.shape)})")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear_rows: bias {tuple(bias.shape)} must be [{n}]")


def _launch(x2, weight, bias, *, r=None, z=None, nw=None, rout=None, eps=0.0, group=None, pro=0, nbg=False,
            **knobs) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    cfg = {**config(m, n, k, weight.dtype), **knobs}
    bm = max(2, triton.next_power_of_2(m))
    bk = min(cfg["block_k"], triton.next_power_of_2(group or k))
    y = torch.empty(m, n, device=x2.device, dtype=x2.dtype)
    dummy = x2
    _linear_rows_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x2, r if r is not None else dummy, z if z is not None else dummy, nw if nw is not None else dummy, weight,
        bias if bias is not None else weight, y, rout if rout is not None else y, m, n, *x2.stride(),
        r.stride(0) if r is not None else 0, z.stride(0) if z is not None else 0, *weight.stride(), y.stride(0),
        rout.stride(0) if rout is not None else 0, eps,
        G=k // (group or k), GS=group or k, BM=bm, BN=cfg["block_n"], BK=bk, UNROLL=cfg["unroll"],
        STAGES=cfg["num_stages"], PRO=pro, HAS_RES=r is not None, NBG=nbg, HAS_BIAS=bias is not None,
        num_warps=cfg["num_warps"], **pdl.launch_args(x2.device),
    )
    return y


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       **knobs) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows (leading dims flattened) and K <= ``MAX_K``.
    ``knobs`` (block_n, block_k, unroll, num_warps, num_stages) override ``config`` (benchmarks, tests)."""
    x2 = x.reshape(-1, x.shape[-1])
    _check(x2, weight, bias)
    return _launch(x2, weight, bias, **knobs).reshape(*x.shape[:-1], weight.shape[0])


def add_rmsnorm_linear_rows_triton(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None, **knobs):
    """``add_rmsnorm`` then ``F.linear`` in one launch: returns ``(y, new residual)`` (see ``norm_linear``)."""
    d = x.shape[-1]
    x2 = row_major(x, d)
    _check(x2, weight, bias)
    r = row_major(residual, d) if residual is not None else None
    rout = torch.empty(x2.shape, device=x.device, dtype=torch.float32 if residual_in_fp32 else x.dtype)
    y = _launch(x2, weight, bias, r=r, nw=norm_weight, rout=rout, eps=eps, pro=1, **knobs)
    return y.reshape(*x.shape[:-1], weight.shape[0]), rout.view(x.shape)


def gated_rmsnorm_linear_rows_triton(y, z, norm_weight, group_size, eps, norm_before_gate, weight, bias=None,
                                     **knobs):
    """``gated_rmsnorm`` then ``F.linear`` in one launch (see ``norm_linear``)."""
    d = y.shape[-1]
    if d % group_size:
        raise ValueError(f"gated norm: {d} channels do not split into groups of {group_size}")
    y2, z2 = row_major(y, d), row_major(z, d)
    _check(y2, weight, bias)
    out = _launch(y2, weight, bias, z=z2, nw=norm_weight, eps=eps, group=group_size, pro=2, nbg=norm_before_gate,
                  **knobs)
    return out.reshape(*y.shape[:-1], weight.shape[0])
