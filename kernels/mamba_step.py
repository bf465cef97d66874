"""One whole Mamba2 decode step after in_proj, as plain PyTorch: conv (state roll), activation,
dt softplus (+clamp), SSM state update, ``y`` and the D skip. Defines the fused kernel's math."""

from __future__ import annotations

import torch

from stree.kernels.pointwise import conv_activation, dt_ref
from stree.kernels.tree_scan import heads_from_groups


def mamba_step_ref(
    conv_state: torch.Tensor,  # [B, C, K-1] pre-conv inputs, oldest first; updated in place
    ssm_state: torch.Tensor,  # [B, H, P, S] float32; updated in place
    xBC: torch.Tensor,  # [B, C] pre-conv input of the new token, C = H*P + 2*G*S
    dt_raw: torch.Tensor,  # [B, H] before bias and softplus
    conv_w: torch.Tensor,  # [C, K]
    conv_b: torch.Tensor | None,  # [C]
    dt_bias: torch.Tensor,  # [H]
    A: torch.Tensor,  # [H] negative
    D: torch.Tensor,  # [H] or [H*P]
    ngroups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str = "silu",
) -> torch.Tensor:
    """Returns ``y + D x`` as ``[B, H*P]`` in ``xBC``'s dtype."""
    act = conv_activation(activation)
    b, h, p, s = ssm_state.shape
    window = torch.cat([conv_state.to(xBC.dtype), xBC[:, :, None]], dim=2).float()
    conv = (window * conv_w.float()[None]).sum(-1)
    if conv_b is not None:
        conv = conv + conv_b.float()
    if conv_state.shape[2] > 0:
        conv_state.copy_(window[:, :, 1:].to(conv_state.dtype))
    xbc = act(conv).to(xBC.dtype).float()  # rounded like the unfused path
    x = xbc[:, : h * p].reshape(b, h, p)
    Bh = heads_from_groups(xbc[:, h * p: h * p + ngroups * s].reshape(b, ngroups, s), h)
    Ch = heads_from_groups(xbc[:, h * p + ngroups * s:].reshape(b, ngroups, s), h)
    dt = dt_ref(dt_raw, dt_bias, dt_limit)
    decay = torch.exp(dt * A.float())[:, :, None, None]
    new = decay * ssm_state.float() + torch.einsum("bh,bhp,bhs->bhps", dt, x, Bh)
    ssm_state.copy_(new.to(ssm_state.dtype))
    Dp = D.float().reshape(h, -1)  # [H, 1] or [H, P]
    y = torch.einsum("bhps,bhs->bhp", new, Ch) + Dp[None] * x
    return y.reshape(b, h * p).to(xBC.dtype)
