"""The pointwise pieces of a Mamba2 layer shared by the references: the conv activation and dt."""

from __future__ import annotations

import torch

from stree.kernels import rowwise

ACTIVATIONS = {"silu": rowwise.silu, "swish": rowwise.silu, "identity": lambda t: t}
FUSED_ACTIVATIONS = ("silu", "swish")  # the ones the fused Triton kernels implement


def conv_activation(activation: str):
    """The conv activation by name; a ValueError naming the choices for any other."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def dt_ref(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """``softplus(dt_raw + dt_bias)`` in float32, clamped to ``dt_limit`` when it is not (0, inf)."""
    dt = rowwise.softplus(dt_raw.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi < float("inf"):
        dt = dt.clamp(lo, hi)
    return dt
