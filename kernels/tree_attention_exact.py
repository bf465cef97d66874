"""Tree attention of the exact numerics: every query sees its keys in LOGICAL order, as a decode step would.

A tree node at depth d, with ``seqlen`` committed tokens, attends to the committed keys and then to its ancestors
(root first) and itself: logical keys ``0 .. seqlen + d``, key ``seqlen + m`` being its ancestor at depth m, which
sits in cache slot ``seqlen + (that ancestor's node index)``. A plain decode step at the same position sees exactly
these keys, contiguous in its cache. The kernel (``tree_attention_exact_triton``) splits the logical keys into
slices of ``KEY_SPLIT`` from key 0 and merges the slices in order, so a query's result depends only on its own
keys, never on the tree around it, the batch, the cache size or how many programs ran. This reference computes the
same attention with ``rowwise`` sums (its bits depend on nothing else either; the kernel's are its own).
"""

from __future__ import annotations

import math

import torch

from stree.kernels import rowwise

KEY_SPLIT = 512
"""Logical keys per slice of the exact kernel's split over keys (a fixed size, never a fixed count of slices)."""


def ancestor_slots(anc_mask: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]``: entry ``[b, i, m]`` is node i's ancestor at depth m (for m up to i's depth; 0 beyond)."""
    anc = anc_mask.bool()
    b, n, _ = anc.shape
    depth_of = anc.long().cumsum(-1) - 1  # an ancestor's depth is its rank among i's ancestors
    nodes = torch.arange(n, device=anc.device).expand(b, n, n)
    out = torch.zeros(b, n, n + 1, dtype=torch.long, device=anc.device)
    return out.scatter_(2, torch.where(anc, depth_of, n), nodes)[..., :n]


def logical_keys(seqlen: torch.Tensor, anc_mask: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot [B, N, n_keys], count [B, N])``: the cache slot of each node's logical key k, and how many keys each
    node has (``seqlen + depth + 1``)."""
    b, n, _ = anc_mask.shape
    k = torch.arange(n_keys, device=anc_mask.device)[None, None, :]
    rel = k - seqlen[:, None, None]
    up = ancestor_slots(anc_mask).gather(2, rel.clamp(0, n - 1).expand(b, n, n_keys))
    slot = torch.where(rel < 0, k, seqlen[:, None, None] + up)
    return slot, seqlen[:, None] + anc_mask.bool().sum(-1)


def tree_attention_exact_ref(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale=None, is_chain: bool = False):
    """``tree_attention_ref``'s contract in logical key order: ``[B, N, Hq, D]`` in ``q``'s dtype. ``is_chain``
    (``anc_mask`` is lower-triangular) is the kernel's hint; the reference reads the mask."""
    b, n, hq, d = q.shape
    cap, hkv = k_cache.shape[1], k_cache.shape[2]
    n_keys = int((seqlen + n).max()) if b else 0
    slot, count = logical_keys(seqlen, anc_mask, n_keys)
    valid = (torch.arange(n_keys, device=q.device)[None, None, :] < count[..., None]) & (slot < cap)
    slot = torch.where(valid, slot, 0)
    rows = torch.arange(b, device=q.device)[:, None, None]
    k = k_cache[rows, slot].float().repeat_interleave(hq // hkv, dim=3)  # [B, N, keys, Hq, D]
    v = v_cache[rows, slot].float().repeat_interleave(hq // hkv, dim=3)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = rowwise.fixed_sum(q.float()[:, :, None] * k, -1).transpose(2, 3) * scale  # [B, N, Hq, keys]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = rowwise.softmax(scores, -1)
    out = rowwise.fixed_sum(p[..., None] * v.transpose(2, 3), -2)  # [B, N, Hq, D]
    return out.to(q.dtype)
