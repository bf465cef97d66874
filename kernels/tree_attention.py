"""Tree attention over a KV cache, and KV compaction of the accepted path.

The tree's K/V sit in the cache right after the committed ``seqlen`` slots (node i at slot
``seqlen + i``). Node i attends to every committed slot and to the slots of its ancestors and
itself. After verification the accepted nodes' K/V move to contiguous slots; the rest is dropped.
Prefill is the same call with a chain (lower-triangular) mask.
"""

from __future__ import annotations

import math

import torch


def tree_attention_mask(seqlen: torch.Tensor, anc_mask: torch.Tensor, cache_len: int) -> torch.Tensor:
    """``[B, N, L]`` bool: key slot j is visible to tree node i."""
    b, n, _ = anc_mask.shape
    slots = torch.arange(cache_len, device=anc_mask.device)
    committed = slots[None, :] < seqlen[:, None]  # [B, L]
    rel = slots[None, :] - seqlen[:, None]  # slot -> tree node index
    in_tree = (rel >= 0) & (rel < n)
    tree_vis = torch.gather(anc_mask, 2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, cache_len))
    return committed[:, None, :] | (in_tree[:, None, :] & tree_vis)


def tree_attention_ref(
    q: torch.Tensor,  # [B, N, Hq, D]
    k_cache: torch.Tensor,  # [B, L, Hkv, D], tree K already written at seqlen + i
    v_cache: torch.Tensor,  # [B, L, Hkv, D]
    seqlen: torch.Tensor,  # [B] committed slots
    anc_mask: torch.Tensor,  # [B, N, N]
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Plain-PyTorch masked attention; returns ``[B, N, Hq, D]`` in ``q``'s dtype."""
    b, n, hq, d = q.shape
    hkv = k_cache.shape[2]
    used = min(int((seqlen + n).max()), k_cache.shape[1])  # padded prefill rows may reach past the cache
    k = k_cache[:, :used].float().repeat_interleave(hq // hkv, dim=2)
    v = v_cache[:, :used].float().repeat_interleave(hq // hkv, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k) * scale
    mask = tree_attention_mask(seqlen, anc_mask, used)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def kv_commit_ref(
    k_cache: torch.Tensor,  # [B, L, Hkv, D], in place
    v_cache: torch.Tensor,
    seqlen: torch.Tensor,  # [B] committed slots before this step
    path: torch.Tensor,  # [B, M] accepted node indices, root first
    path_len: torch.Tensor,  # [B]
) -> None:
    """Move node ``path[m]``'s K/V from slot ``seqlen + path[m]`` to ``seqlen + m`` (m < path_len)."""
    for b in range(path.shape[0]):
        m = int(path_len[b])
        src = int(seqlen[b]) + path[b, :m]
        dst = int(seqlen[b]) + torch.arange(m, device=path.device)
        k_cache[b, dst] = k_cache[b, src].clone()
        v_cache[b, dst] = v_cache[b, src].clone()
