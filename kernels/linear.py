"""``y = x W^T + b`` for the few rows of a decode step or tree pass: cuBLAS, padded cuBLAS or Triton, timed.

cuBLAS picks poor kernels at some small row counts: measured on the H100 (fp32, the demo target),
its in_proj takes 15.5 us at 5 rows against 4.0 at 8 and 7.0 at 16, and every tree pass pays that
per layer. So, once per (rows, weight shape, dtype, device), ``linear`` times the plain call
against zero-padding the input to 8, 16 or 32 rows (pad included, in a CUDA graph) and against the
few-row Triton kernel (``linear_rows_triton``, also the one-row decode GEMV), and keeps another
choice than the plain call only where it is clearly faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.kernels import backend, pdl
from stree.kernels.backend import capturing
from stree.kernels.cuda_graph import graphed_fastest

PAD_ROWS = (8, 16, 32)  # row counts a few-row input may be padded to
MIN_GAIN = 0.85  # leave the plain call only for a choice taking at most this fraction of its time
TRITON = "triton"  # the choice of the few-row Triton kernel (the others are row counts for cuBLAS)
_CHOICE: dict = {}


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``F.linear`` computed on ``x`` zero-padded to ``rows`` rows (``rows`` >= x's rows), padding dropped."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if rows < m:
        raise ValueError(f"padded_linear: cannot pad {m} rows down to {rows}")
    y = F.linear(F.pad(x2, (0, 0, 0, rows - m)) if rows > m else x2, weight, bias)[:m]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def run_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, choice) -> torch.Tensor:
    """``F.linear`` the way ``choice`` says: ``TRITON`` or the row count to pad to."""
    if choice == TRITON:
        from stree.kernels.linear_rows_triton import linear_rows_triton

        return linear_rows_triton(x, weight, bias)
    return padded_linear(x, weight, bias, choice)


def choose_rows(m: int, weight: torch.Tensor, bias: torch.Tensor | None):
    """How to run an ``m``-row input: a row count for cuBLAS (``m`` itself unless a padding measured
    clearly faster) or ``TRITON``."""
    key = (m, tuple(weight.shape), weight.dtype, weight.device, bias is not None, pdl.setting())
    if key not in _CHOICE:
        if capturing():  # no timing inside a capture: unpadded, and decided on the next eager call
            return m
        from stree.kernels.linear_rows_triton import fits

        x = torch.zeros(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        triton = fits(m, weight) and backend.resolve(weight.device) == "triton"
        choices = [r for r in (m,) + PAD_ROWS if r >= m] + ([TRITON] if triton else [])
        _CHOICE[key] = graphed_fastest({c: lambda c=c: run_choice(x, weight, bias, c) for c in choices}, m, MIN_GAIN)
    return _CHOICE[key]


def row_choices() -> dict:
    """What was decided so far: ``{(rows, (out, in), dtype): padded rows or TRITON}`` (benchmarks, tests)."""
    return {(k[0], k[1], str(k[2]).removeprefix("torch.")): v for k, v in _CHOICE.items()}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; CUDA inference with 1 to ``PAD_ROWS[-1]`` - 1 rows runs as ``choose_rows`` chose."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (not x.is_cuda or not 1 <= m < PAD_ROWS[-1]
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    return run_choice(x, weight, bias, choose_rows(m, weight, bias))
