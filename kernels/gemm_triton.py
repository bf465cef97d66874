"""``y = x W^T + b`` in Triton with one tile configuration per weight: every row is computed by the same code
whatever the row count (reference: ``gemm.gemm_ref``; the ``exact`` numerics' projections and LM head).

``gemm_config`` derives the tiles (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, warps, pipeline stages) and the split of
K from the weight's shape and dtype and the GPU's SM count only, never from the row count M. A program owns a
``BLOCK_M x BLOCK_N`` output tile and one of ``split_k`` equal slices of K, walked in ``BLOCK_K`` chunks in order
with fp32 accumulation. With ``split_k > 1`` each program stores its partial tile, and the last of a tile's programs
to arrive adds the partials in slice order (0, 1, ...), adds the bias and rounds once. So a row's sum has the same
order for one row (a decode step) as for two thousand (a tree pass of a batch): what a library GEMM, which picks
kernels and splits per row count, does not give. The split lets a one-row GEMV with few output columns still fill
the GPU (the 2.7B out_proj has 2560); it is fixed per weight, so large row counts pay for it too.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.arrival import counters
from stree.kernels.pdl import pdl_enter

BLOCK_M_HALF = 64
"""Rows per tile in bf16/fp16 (one Hopper warpgroup MMA); fixed, so every row count meets the same instructions."""
BLOCK_M_FP32 = 32
MAX_SPLIT_K = 8


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, k_split,
                 s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                 STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    k_lo = pid_k * k_split
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, k_split, BK, num_stages=STAGES):
        ks = k_lo + k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * s_wn + ks[None, :] * s_wk, mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        # Each slice stores its partial tile; the tile's last program to arrive sums them in slice order.
        tile = pid_m * tl.num_programs(1) + pid_n
        part = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part + pid_k * M * N, acc, mask=out_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1)
        if arrived == SPLIT_K - 1:
            acc = tl.load(part, mask=out_ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part + s * M * N, mask=out_ok, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
                     mask=out_ok)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty), mask=out_ok)


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    """Programs one launch should reach: the SM count on a GPU, 4 for the CPU interpreter (small test grids)."""
    return sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def gemm_config(n: int, k: int, dtype: torch.dtype, sms: int) -> dict:
    """The tiles of every GEMM against an ``[n, k]`` weight of ``dtype`` (never a function of the row count).

    The widest column block (128, 64 or 32) that still gives every SM a tile at one row block; where even 32
    columns give fewer tiles than SMs, K is split (into 2, 4 or 8 slices of at least two chunks each) until they
    do. A one-row decode step is a weight stream: it wants every SM busy; a tree pass of many rows wants wide
    tiles. Both get the same code per row.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    bm, bk = (BLOCK_M_HALF, 64) if half else (BLOCK_M_FP32, 32)
    bn = 32
    for wide in (128, 64):
        if triton.cdiv(n, wide) >= sms:
            bn = wide
            break
    split = 1
    while (triton.cdiv(n, bn) * split < sms and split < MAX_SPLIT_K
           and triton.cdiv(k, 2 * split) >= 2 * bk):
        split *= 2
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=4 if half else 2)


def gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out=None,
                **knobs) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (leading dims of ``x`` flattened) with ``gemm_config``'s tiles; ``knobs``
    (block_m, block_n, block_k, split_k, num_warps, num_stages) override them (tests, benchmarks)."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"gemm: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} (same dtype, K = {k})")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemm: bias {tuple(bias.shape)} must be [{n}]")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out.view(m, n)
    if m == 0 or n == 0:
        return y.reshape(*x.shape[:-1], n)
    cfg = {**gemm_config(n, k, weight.dtype, _sms(x.device)), **knobs}
    bm, bn, bk, split = cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["split_k"]
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    count = counters(x.device, grid[0] * grid[1]) if split > 1 else y
    _gemm_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, part, count, m, n, k, k_split,
        *x2.stride(), *weight.stride(), *y.stride(),
        BM=bm, BN=bn, BK=bk, SPLIT_K=split, STAGES=cfg["num_stages"], HAS_BIAS=bias is not None,
        IEEE=weight.dtype == torch.float32, num_warps=cfg["num_warps"], enable_fp_fusion=False,
        **pdl.launch_args(x.device),
    )
    return y.reshape(*x.shape[:-1], n)
