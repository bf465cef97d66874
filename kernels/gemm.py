"""``y = x W^T + b`` with every row computed the same way whatever the row count: the projections and the LM head
of the ``exact`` numerics (reference: ``gemm_ref``; kernel: ``gemm_triton``).

A library GEMM picks its kernel (tile shape, split of K) per row count, so a one-row decode step and a 5- or
2048-row tree pass add a row's products in different orders and round differently. Here every call has one shape
per block of ``GEMM_ROWS`` rows: the input is cut into blocks of that many rows (the last zero-padded) and each
block is one ``F.linear`` call of the same shape, so a row's result does not depend on how many rows came with it
or where it sits (``tests/kernels/test_kernels_gemm.py`` checks both, and that a GEMM on the raw row count fails
the same check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMM_ROWS = 16


def gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over blocks of ``GEMM_ROWS`` rows (leading dims flattened), in ``x``'s dtype."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % GEMM_ROWS
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    blocks = [F.linear(x2[i: i + GEMM_ROWS], weight, bias) for i in range(0, m + pad, GEMM_ROWS)]
    y = torch.cat(blocks)[:m] if blocks else x2.new_zeros(0, n)
    return y.reshape(*x.shape[:-1], n)
