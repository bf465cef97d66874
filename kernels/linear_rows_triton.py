"""``y = x W^T + b`` for a few rows (a tree pass's projections) in one Triton launch (reference: ``F.linear``).

Each program owns ``BN`` = 4 output columns for every row, loads its whole slice of ``W`` (K in
``NK`` unrolled blocks, so every load is issued before the first product) and sums FMA products in
fp32. The narrow column block gives hundreds of programs even for a 256-column projection, which is
what a launch-bound few-row GEMM needs. Measured on the H100 (fp32, demo target, 5 rows) it takes
2.5-3.6 us where cuBLAS takes 5.7-6.3 us (padded or not); an earlier version with 16-column blocks
and a K loop was slower than cuBLAS. ``linear.choose_rows`` times it beside cuBLAS per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 32
MAX_K = 2048  # the unrolled K blocks stay in registers up to here; larger weights are cuBLAS territory
BLOCK_N = 4
_TILE = 16384  # BM * BN * BK elements of products per block


@triton.jit
def _linear_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in tl.static_range(NK):
        ks = kb * BK + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * s_xm + ks[None, :] * s_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * s_wn + ks[None, :] * s_wk, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fits(m: int, weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``m`` rows against ``weight`` (few rows, a K that stays in registers)."""
    return 1 <= m <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K


def linear_rows_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows (leading dims flattened) and K <= ``MAX_K``."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    if not fits(m, weight) or weight.shape[1] != k:
        raise ValueError(f"linear_rows: x {tuple(x.shape)} must have 1..{MAX_ROWS} rows of K = weight's "
                         f"{weight.shape[1]} <= {MAX_K} (weight {tuple(weight.shape)})")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear_rows: bias {tuple(bias.shape)} must be [{n}]")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = max(2, triton.next_power_of_2(m))
    bk = min(triton.next_power_of_2(k), _TILE // (bm * BLOCK_N))
    _linear_rows_kernel[(triton.cdiv(n, BLOCK_N),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, *x2.stride(), *weight.stride(), y.stride(0),
        BM=bm, BN=BLOCK_N, BK=bk, NK=triton.cdiv(k, bk), HAS_BIAS=bias is not None, num_warps=2 if bm <= 8 else 4,
    )
    return y.reshape(*x.shape[:-1], n)
