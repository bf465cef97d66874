"""Plain-PyTorch pieces whose result for an element or a row never depends on the tensor around it.

The references of the ``exact`` numerics (``numerics.py``) are built from these, so on the CPU too a row computed
alone, inside a block of rows, at another offset or inside another tree gives the same bits:

- ``fixed_sum``: a sum over one dimension by pairwise halving over its length zero-padded to a power of two. The
  order of additions depends only on the positions of the terms, and trailing zero padding changes nothing, so a
  row of 5 terms sums the same alone or padded to 8, 64 or 1024.
- ``pointwise``: a unary function applied element by element through PyTorch's scalar CPU loop. PyTorch's CPU
  kernels compute transcendental functions (SiLU, softplus, sigmoid, GELU, ...) with SIMD code over most of a
  tensor and scalar code over its tail, and the two can differ in the last bit: an element's value would depend on
  the tensor's size. A strided view takes the scalar loop for every element. CUDA kernels compute every element
  with the same code, so there the function runs as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fixed_sum(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``t.sum(dim)`` in an order that depends only on each term's index (pairwise halving, zero-padded)."""
    t = t.movedim(dim, -1)
    n = t.shape[-1]
    if n == 0:
        return t.new_zeros(t.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        t = F.pad(t, (0, width - n))
    while t.shape[-1] > 1:
        half = t.shape[-1] // 2
        t = t[..., :half] + t[..., half:]
    return t[..., 0]


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` with every element computed the same way wherever it sits (see the module docstring)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return fn(x)
    spread = x.new_empty(*x.shape, 2)
    spread[..., 0] = x
    return fn(spread[..., 0]).contiguous()


def silu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.softplus, x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.sigmoid, x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return pointwise(F.gelu, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return pointwise(torch.exp, x)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``softmax`` over ``dim`` from ``exp`` and ``fixed_sum`` (a row's result is independent of the other rows)."""
    e = exp(x - x.amax(dim, keepdim=True))
    return e / fixed_sum(e, dim).unsqueeze(dim)
