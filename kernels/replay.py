"""Activation replay: advance SSM and conv states along the accepted path, from the tree pass's cache.

``H' = exp(s_k) H_0 + sum_m exp(s_k - s_m) dt_{p_m} B_{p_m} x_{p_m}^T`` with ``s`` the cumulative
sum of ``dt * A`` along the path ``p_0..p_k``; the new conv state is the last ``K-1`` pre-conv rows
along the committed sequence extended by the path. No second model pass; cost follows the path.
"""

from __future__ import annotations

import torch

from stree.kernels.tree_scan import heads_from_groups


def replay_ref(
    ssm_state: torch.Tensor,  # [B, H, P, S], updated in place
    conv_state: torch.Tensor,  # [B, C, K-1], updated in place
    x: torch.Tensor,  # [B, N, H, P] cached from the tree pass
    dt: torch.Tensor,  # [B, N, H] cached (after softplus)
    A: torch.Tensor,  # [H]
    Bm: torch.Tensor,  # [B, N, G, S] cached
    xBC: torch.Tensor,  # [B, N, C] cached pre-conv inputs
    path: torch.Tensor,  # [B, M] node indices, root first; padded past path_len
    path_len: torch.Tensor,  # [B] >= 1
) -> None:
    """Plain-PyTorch replay; writes the new states into ``ssm_state`` and ``conv_state``."""
    b, m = path.shape
    nheads = x.shape[2]
    valid = torch.arange(m, device=path.device)[None, :] < path_len[:, None]  # [B, M]
    p = torch.where(valid, path, torch.zeros_like(path))
    gx = torch.gather(x.float(), 1, p[:, :, None, None].expand(-1, -1, *x.shape[2:]))
    gdt = torch.gather(dt.float(), 1, p[:, :, None].expand(-1, -1, nheads)) * valid[..., None]
    gB = heads_from_groups(torch.gather(Bm.float(), 1, p[:, :, None, None].expand(-1, -1, *Bm.shape[2:])), nheads)
    s = torch.cumsum(gdt * A.float(), dim=1)  # [B, M, H]; padded steps add 0
    total = s[:, -1]  # [B, H]
    decay = torch.exp(total[:, None, :] - s) * valid[..., None]  # [B, M, H]
    upd = torch.einsum("bmh,bmh,bmhp,bmhs->bhps", decay, gdt, gx, gB)
    new_ssm = torch.exp(total)[:, :, None, None] * ssm_state.float() + upd
    ssm_state.copy_(new_ssm.to(ssm_state.dtype))

    km1 = conv_state.shape[2]
    if km1 > 0:
        rows = torch.gather(xBC, 1, p[:, :, None].expand(-1, -1, xBC.shape[2]))  # [B, M, C]
        ext = torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), rows], dim=1)  # [B, K-1+M, C]
        take = path_len[:, None] + torch.arange(km1, device=path.device)[None, :]  # rows ending at path end
        new_conv = torch.gather(ext, 1, take[:, :, None].expand(-1, -1, ext.shape[2]))  # [B, K-1, C]
        conv_state.copy_(new_conv.transpose(1, 2).to(conv_state.dtype))


def replay_layers_ref(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len) -> None:
    """``replay_ref`` on every layer of stacked ``[L, ...]`` states and activations (one shared path per row)."""
    for layer in range(ssm_state.shape[0]):
        replay_ref(ssm_state[layer], conv_state[layer], x[layer], dt[layer], A[layer], Bm[layer], xBC[layer], path,
                   path_len)
