"""Prefill of a Mamba2 layer over T tokens with an initial state: chunked SSD and conv, in plain PyTorch.

Within a chunk the output is the quadratic (attention-like) SSD form; between chunks the state is
carried. This is the reference the GPU prefill (mamba_ssm's chunk scan when installed) must match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.kernels.tree_scan import heads_from_groups


def conv_prefill_ref(
    xBC: torch.Tensor,  # [B, T, C]
    conv_state: torch.Tensor,  # [B, C, K-1], updated in place
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Causal depthwise conv continuing from ``conv_state``; returns ``silu(conv)`` ``[B, T, C]``."""
    width = weight.shape[1]
    ext = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=2)  # [B, C, K-1+T]
    out = F.conv1d(ext.float(), weight.float()[:, None, :], bias.float() if bias is not None else None,
                   groups=weight.shape[0])  # [B, C, T]
    if width > 1:
        conv_state.copy_(ext[:, :, -(width - 1):].to(conv_state.dtype))
    return F.silu(out).transpose(1, 2).to(xBC.dtype)


def ssd_prefill_ref(
    x: torch.Tensor,  # [B, T, H, P]
    dt: torch.Tensor,  # [B, T, H] after softplus
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, T, G, S]
    Cm: torch.Tensor,  # [B, T, G, S]
    D: torch.Tensor,  # [H]
    ssm_state: torch.Tensor,  # [B, H, P, S] initial state, replaced by the final state in place
    chunk_size: int = 64,
) -> torch.Tensor:
    """Chunked SSD; returns ``y`` ``[B, T, H, P]``."""
    nheads = x.shape[2]
    T = x.shape[1]
    state = ssm_state.float().clone()  # a copy: ssm_state is overwritten below, after autograd saved state
    Af = A.float()
    ys = []
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        xc, dtc = x[:, sl].float(), dt[:, sl].float()
        Bc = heads_from_groups(Bm[:, sl].float(), nheads)
        Cc = heads_from_groups(Cm[:, sl].float(), nheads)
        s = torch.cumsum(dtc * Af, dim=1)  # [B, L, H]
        L = s.shape[1]
        seg = s[:, :, None, :] - s[:, None, :, :]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        seg = seg.masked_fill(~causal[None, :, :, None], float("-inf"))
        cb = torch.einsum("bihs,bjhs->bijh", Cc, Bc)
        y = torch.einsum("bijh,bjh,bjhp->bihp", torch.exp(seg) * cb, dtc, xc)
        y = y + torch.exp(s)[..., None] * torch.einsum("bihs,bhps->bihp", Cc, state)
        ys.append(y + D.float()[None, None, :, None] * xc)
        total = s[:, -1]
        decay = torch.exp(total[:, None, :] - s)
        state = torch.exp(total)[:, :, None, None] * state + torch.einsum(
            "bmh,bmh,bmhp,bmhs->bhps", decay, dtc, xc, Bc
        )
    ssm_state.copy_(state.to(ssm_state.dtype))
    return torch.cat(ys, dim=1).to(x.dtype)
