"""One-token decode step of a Mamba2 layer: conv-state roll and SSM state update, in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.kernels.tree_scan import heads_from_groups


def conv_step_ref(
    conv_state: torch.Tensor,  # [B, C, K-1], updated in place
    xBC: torch.Tensor,  # [B, C] pre-conv input of the new token
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Returns ``silu(conv)`` ``[B, C]`` for the new token and rolls it into the conv state."""
    window = torch.cat([conv_state.to(xBC.dtype), xBC[:, :, None]], dim=2).float()  # [B, C, K]
    out = (window * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if conv_state.shape[2] > 0:
        conv_state.copy_(window[:, :, 1:].to(conv_state.dtype))
    return F.silu(out).to(xBC.dtype)


def ssd_step_ref(
    ssm_state: torch.Tensor,  # [B, H, P, S], updated in place
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H] after softplus
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, G, S]
    Cm: torch.Tensor,  # [B, G, S]
    D: torch.Tensor,  # [H]
) -> torch.Tensor:
    """``H = exp(dt A) H + dt B x^T``; ``y = C^T H + D x``. Returns ``y`` ``[B, H, P]``."""
    nheads = x.shape[1]
    dtf = dt.float()
    Bh = heads_from_groups(Bm.float(), nheads)  # [B, H, S]
    Ch = heads_from_groups(Cm.float(), nheads)
    decay = torch.exp(dtf * A.float())[:, :, None, None]
    new = decay * ssm_state.float() + torch.einsum("bh,bhp,bhs->bhps", dtf, x.float(), Bh)
    ssm_state.copy_(new.to(ssm_state.dtype))
    y = torch.einsum("bhps,bhs->bhp", new, Ch) + D.float()[None, :, None] * x.float()
    return y.to(x.dtype)
