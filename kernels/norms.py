"""The RMSNorms around each mixer: residual-add + RMSNorm, and Mamba2's gated grouped RMSNorm.

Unfused, each is five or more small kernels per layer per step; on a 64-layer model that launch
count, not the weights, dominates a decode step. These references define the fused kernels' math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.kernels import numerics, rowwise


def rms_norm(x: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """``F.rms_norm`` over the last ``width`` elements (float32); in exact numerics the mean of squares is a
    ``rowwise.fixed_sum``, so a row's result never depends on the other rows."""
    if not numerics.exact():
        return F.rms_norm(x, (width,), eps=eps)
    return x * rowwise.pointwise(torch.rsqrt, rowwise.fixed_sum(x * x, -1)[..., None] / width + eps)


def add_rmsnorm_ref(
    x: torch.Tensor,  # [..., d] mixer output (or the embedding at the first layer)
    residual: torch.Tensor | None,  # [..., d] running residual, or None at the first layer
    weight: torch.Tensor,  # [d]
    eps: float,
    residual_in_fp32: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``r = x + residual`` (float32); returns ``(rmsnorm(r) * weight`` in ``x``'s dtype, new residual)."""
    r = x.float() if residual is None else x.float() + residual.float()
    out = rms_norm(r, r.shape[-1], eps) * weight.float()
    return out.to(x.dtype), (r if residual_in_fp32 else r.to(x.dtype))


def gated_rmsnorm_ref(
    y: torch.Tensor,  # [..., d]
    z: torch.Tensor,  # [..., d] gate
    weight: torch.Tensor,  # [d]
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """mamba_ssm's RMSNormGated: ``norm(y * silu(z)) * w`` per group (or ``norm(y) * w * silu(z)``)."""
    yf, zf = y.float(), z.float()
    gate = rowwise.silu(zf)
    g = yf if norm_before_gate else yf * gate
    shape = g.shape
    g = rms_norm(g.reshape(*shape[:-1], -1, group_size), group_size, eps).reshape(shape)
    out = g * weight.float()
    if norm_before_gate:
        out = out * gate
    return out.to(y.dtype)
