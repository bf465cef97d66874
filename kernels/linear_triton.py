"""``y = x W^T + b`` for a few rows (a tree pass's projections) as one Triton launch of FMA products.

cuBLAS's kernel choice at 2-32 rows is erratic (a split-K GEMM and a reduce at some row counts, a
30 µs kernel at others; see ``linear.py``). Here each program owns a block of output columns for
every row at once and streams its slice of ``W`` once; ``linear.choose_rows`` times it against
cuBLAS per shape and keeps whichever is faster. Reference: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 32


@triton.jit
def _few_row_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, s_x, s_w, s_y,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    col_ok = cols < N
    row_ok = rows < M
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None] * s_x[0] + ks[None, :] * s_x[1], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None] * s_w[0] + ks[None, :] * s_w[1], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * s_y[0] + cols[None, :] * s_y[1], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def few_row_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          block_n: int = 16) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows (leading dims flattened)."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"few_row_linear: x {tuple(x.shape)} must have at most {MAX_ROWS} rows of "
                         f"{weight.shape[1]} (weight {tuple(weight.shape)})")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"few_row_linear: bias {tuple(bias.shape)} must be [{n}]")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = max(2, triton.next_power_of_2(m))
    bk = max(16, min(128, 8192 // (bm * block_n)))
    _few_row_linear_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(), weight.stride(), y.stride(),
        BM=bm, BN=block_n, BK=bk, HAS_BIAS=bias is not None, num_warps=4,
    )
    return y.reshape(*x.shape[:-1], n)
