"""A norm and the projection after it in one launch: residual add + RMSNorm -> ``in_proj``, and Mamba2's
gated grouped RMSNorm -> ``out_proj`` (references: the two ops in sequence).

Per Mamba2 layer that removes two of the five launches of a decode step or tree pass. Whether the fused
few-row kernel (``linear_rows_triton``, ``PRO`` 1/2) wins depends on the shape, so, like
``linear.choose_rows``, the first eager call per (kind, rows, shapes, dtype) times it against the
norm kernel followed by ``ops.linear`` and keeps the faster; under capture an undecided shape runs unfused.
Fusion tends to win at small widths and few rows and to lose at wide layers, where each program re-reads the
whole input row for the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.kernels import backend, pdl
from stree.kernels.backend import capturing
from stree.kernels.cuda_graph import graphed_fastest
from stree.kernels.norms import add_rmsnorm_ref, gated_rmsnorm_ref

_FUSED: dict = {}


def add_rmsnorm_linear_ref(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None):
    """``(F.linear(rmsnorm(x + residual) * norm_weight, weight, bias), x + residual)``, as ``add_rmsnorm_ref``."""
    h, r = add_rmsnorm_ref(x, residual, norm_weight, eps, residual_in_fp32)
    return F.linear(h, weight, bias), r


def gated_rmsnorm_linear_ref(y, z, norm_weight, group_size, eps, norm_before_gate, weight, bias=None):
    """``F.linear(gated_rmsnorm_ref(y, z, ...), weight, bias)``."""
    return F.linear(gated_rmsnorm_ref(y, z, norm_weight, group_size, eps, norm_before_gate), weight, bias)


def use_fused(kind: str, x: torch.Tensor, weight: torch.Tensor, fused, unfused) -> bool:
    """Whether ``fused()`` (one launch) measured faster than ``unfused()`` for this kind and shape (timed once;
    the unfused timing's warm-up lets ``ops.linear`` make its own choice first)."""
    from stree.kernels.linear_rows_triton import fits

    rows = x.numel() // x.shape[-1]
    if backend.resolve(x.device) != "triton" or torch.is_grad_enabled() or not fits(rows, weight):
        return False
    if not x.is_cuda:  # the Triton backend forced on the CPU (interpreter tests): nothing to time, fuse
        return True
    key = (kind, rows, tuple(x.shape[-1:]), tuple(weight.shape), x.dtype, weight.dtype, x.device, pdl.setting())
    if key not in _FUSED:
        if capturing():
            return False
        _FUSED[key] = graphed_fastest({False: unfused, True: fused}, False)
    return _FUSED[key]


def fused_choices() -> dict:
    """What was decided so far: ``{(kind, rows, (out, in), dtype): fused?}`` (benchmarks, tests)."""
    return {(k[0], k[1], k[3], str(k[4]).removeprefix("torch.")): v for k, v in _FUSED.items()}
