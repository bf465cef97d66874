"""Tree scan: the SSD output of every node of a batch of token trees, with the committed state.

``y_i = exp(S_i) C_i^T H_0 + sum_{j in anc(i)} exp(S_i - S_j) (C_i . B_j) dt_j x_j + D x_i`` where
``S`` is the tree cumulative sum of ``dt * A``. A chain tree gives exactly Mamba2 with an initial state.
"""

from __future__ import annotations

import torch

from stree.protocols.token_tree import ancestor_mask


def tree_cumsum_ref(a: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """``S_i = S_parent(i) + a_i`` over nodes in topological order; ``a`` is ``[B, N, H]``."""
    b, n = parents.shape
    out = torch.empty_like(a)
    ar = torch.arange(b, device=a.device)
    out[:, 0] = a[:, 0]
    for i in range(1, n):
        out[:, i] = out[ar, parents[:, i].clamp(min=0)] + a[:, i]
    return out


def heads_from_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """Expand ``[..., G, S]`` group tensors to ``[..., H, S]`` (head h uses group h // (H/G))."""
    groups = t.shape[-2]
    return t.repeat_interleave(nheads // groups, dim=-2)


def tree_scan_ref(
    x: torch.Tensor,  # [B, N, H, P]
    dt: torch.Tensor,  # [B, N, H], after softplus
    A: torch.Tensor,  # [H], negative
    Bm: torch.Tensor,  # [B, N, G, S]
    Cm: torch.Tensor,  # [B, N, G, S]
    D: torch.Tensor,  # [H]
    parents: torch.Tensor,  # [B, N] long, parents[:, 0] == -1
    ssm_state: torch.Tensor,  # [B, H, P, S], the committed state H_0
) -> torch.Tensor:
    """Plain-PyTorch tree-masked SSD; returns ``y`` ``[B, N, H, P]`` in ``x``'s dtype."""
    nheads = x.shape[2]
    xf, dtf = x.float(), dt.float()
    Bh = heads_from_groups(Bm.float(), nheads)  # [B, N, H, S]
    Ch = heads_from_groups(Cm.float(), nheads)
    S = tree_cumsum_ref(dtf * A.float(), parents)  # [B, N, H]
    mask = ancestor_mask(parents)  # [B, N, N]
    seg = S[:, :, None, :] - S[:, None, :, :]  # [B, i, j, H]
    seg = seg.masked_fill(~mask[..., None], float("-inf"))
    cb = torch.einsum("bihs,bjhs->bijh", Ch, Bh)
    y = torch.einsum("bijh,bjh,bjhp->bihp", torch.exp(seg) * cb, dtf, xf)
    y = y + torch.exp(S)[..., None] * torch.einsum("bihs,bhps->bihp", Ch, ssm_state.float())
    y = y + D.float()[None, None, :, None] * xf
    return y.to(x.dtype)
