"""Tree conv1d: the depthwise causal conv of each tree node over its own ancestors.

Node i's taps are i, parent(i), grandparent(i), ...; taps above the root come from the
committed conv state (the last ``K-1`` pre-conv inputs of the committed sequence). The activation
(SiLU) follows; ``tree_conv_dt_ref`` also computes the tree's dt, as its fused kernel does.
"""

from __future__ import annotations

import torch

from stree.kernels.pointwise import conv_activation, dt_ref


def tree_conv_taps(parents: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, N, K]`` row indices into ``cat(conv_state^T, xBC)`` (``K-1+N`` rows) for each tap.

    Tap k of node i is its k-th ancestor (``k = 0`` is i itself); ``K-1+node`` addresses a tree
    row, and ``0..K-2`` the committed rows (``K-2`` being the most recent).
    """
    b, n = parents.shape
    km1 = width - 1
    idx = torch.empty(b, n, width, dtype=torch.long, device=parents.device)
    cur = torch.arange(n, device=parents.device).expand(b, n).clone()  # current ancestor (>= 0) or -(steps above root)
    for k in range(width):
        idx[:, :, k] = km1 + cur  # cur == -m addresses the m-th most recent committed row
        up = torch.where(cur > 0, torch.gather(parents, 1, cur.clamp(min=0)), cur - 1)
        cur = torch.where(cur == 0, torch.full_like(cur, -1), up)
    return idx


def tree_conv1d_ref(
    xBC: torch.Tensor,  # [B, N, C] pre-conv inputs of the tree nodes
    conv_state: torch.Tensor,  # [B, C, K-1] committed inputs, oldest first
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    parents: torch.Tensor,  # [B, N]
    activation: str = "silu",
) -> torch.Tensor:
    """Plain-PyTorch tree conv; returns ``act(conv)`` ``[B, N, C]`` in ``xBC``'s dtype."""
    width = weight.shape[1]
    ext = torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), xBC], dim=1).float()  # [B, K-1+N, C]
    taps = tree_conv_taps(parents, width)  # [B, N, K]
    b, n, _ = taps.shape
    rows = torch.gather(ext, 1, taps.reshape(b, n * width, 1).expand(-1, -1, ext.shape[-1]))
    rows = rows.reshape(b, n, width, -1)  # tap k = k-th ancestor
    w = weight.float().flip(-1).t()  # [K, C]; w[k] multiplies the k-th ancestor
    out = (rows * w[None, None]).sum(2)
    if bias is not None:
        out = out + bias.float()
    return conv_activation(activation)(out).to(xBC.dtype)


def tree_conv_dt_ref(xBC, conv_state, weight, bias, parents, dt_raw, dt_bias, dt_limit=(0.0, float("inf")),
                     activation: str = "silu"):
    """The tree pass's pointwise front: ``(act(tree conv) [B, N, C], dt [B, N, H] float32)``."""
    return tree_conv1d_ref(xBC, conv_state, weight, bias, parents, activation), dt_ref(dt_raw, dt_bias, dt_limit)
