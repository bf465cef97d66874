"""How a kernel's output is compared with its reference: one relative error, NaN when it is not finite.

Tests (CPU, interpreter) and the GPU check (``stree bench kernels --check``) use the same measure.
"""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in float64 (Frobenius norms); NaN if ``out`` has a NaN or inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
