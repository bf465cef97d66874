"""The lookup tree rule (``rule.py``) as device code: B trees at once, fixed shapes, no host sync.

``lookup_trees`` takes each sequence's candidate rows ``[B, K, H]`` (their lengths ``[B, K]``, 0 for no row, and
priorities ``[B, K]``) and lays out ``branches`` x ``depth`` nodes level by level below the roots: node ``1 + d *
branches + w`` is branch w's token d. Every step of the rule is a handful of ``[B, K, K, H]`` tensor ops.
"""

from __future__ import annotations

import torch


def prefix_equal(rows: torch.Tensor, lengths: torch.Tensor, others: torch.Tensor = None,
                 other_lengths: torch.Tensor = None) -> torch.Tensor:
    """``[B, I, J, H]``: row i of ``rows`` and row j of ``others`` (default: ``rows``) both have a token d and agree on
    their first ``d + 1`` tokens."""
    if others is None:
        others, other_lengths = rows, lengths
    h = rows.shape[-1]
    steps = torch.arange(h, device=rows.device)
    have = steps < lengths[..., None]  # [B, I, H]
    have_other = steps < other_lengths[..., None]
    same = (rows[:, :, None, :] == others[:, None, :, :]) & have[:, :, None, :] & have_other[:, None, :, :]
    return same.to(torch.uint8).cumprod(-1).bool()


def rank_rows(rows: torch.Tensor, lengths: torch.Tensor, priority: torch.Tensor, branches: int):
    """``(chosen [B, W], present [B, W])``: each sequence's branches (rule steps 1-3), best first; ``present`` False
    where fewer rows are left than ``branches``."""
    b, k, h = rows.shape
    if branches > k:
        raise ValueError(f"lookup tree: {branches} branches need at least as many candidate rows, got {k}")
    eq = prefix_equal(rows, lengths)  # [B, K, K, H]
    score = eq.sum((2, 3))  # [B, K]: sum over depths of the rows sharing the prefix
    index = torch.arange(k, device=rows.device)
    live = lengths > 0
    key = (priority * (k * h + 1) + score) * k + (k - 1 - index)  # distinct per row: ties go to the earlier one
    key = torch.where(live, key, torch.full_like(key, -1))
    # covered[j, i]: row i's tokens are a prefix of row j's (row j has row i's last token, and agrees up to it)
    last = (lengths - 1).clamp(min=0)  # [B, K]
    covered = eq.gather(3, last[:, None, :, None].expand(b, k, k, 1))[..., 0]  # [B, J, I]
    better = key[:, :, None] > key[:, None, :]  # [B, J, I]
    redundant = (covered & better & (index[:, None] != index[None, :])).any(1)  # [B, I]
    keep = torch.where(live & ~redundant, key, torch.full_like(key, -1))
    top = torch.topk(keep, branches, dim=1)
    return top.indices, top.values >= 0


def lookup_trees(roots: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, priority: torch.Tensor,
                 branches: int, depth: int):
    """``(tokens, parents, valid)`` ``[B, 1 + depth * branches]``: the rule's trees (rule.py) in the level-by-level
    layout; absent nodes are invalid (token 0, parent the node above them on their own branch)."""
    b, dev = roots.shape[0], roots.device
    chosen, present = rank_rows(rows, lengths, priority, branches)
    rows = rows.gather(1, chosen[:, :, None].expand(-1, -1, rows.shape[2]))[:, :, :depth]  # [B, W, D]
    lengths = torch.where(present, lengths.gather(1, chosen).clamp(max=depth), torch.zeros_like(chosen))
    w_ids = torch.arange(branches, device=dev)
    eq = prefix_equal(rows, lengths)  # [B, V, W, D]
    earlier = w_ids[:, None] <= w_ids[None, :]  # [V, W]: v <= w
    # rep[b, w, d]: the first branch sharing branch w's first d + 1 tokens (w itself when none earlier; W: absent)
    candidates = torch.where(eq & earlier[None, :, :, None], w_ids[None, :, None, None], branches)
    rep = candidates.amin(1)  # [B, W, D]
    valid = rep == w_ids[None, :, None]  # [B, W, D]
    own = torch.where(rep < branches, rep, w_ids[None, :, None].expand_as(rep))  # absent nodes keep their branch
    above = torch.cat([torch.full_like(own[:, :, :1], -1), own[:, :, :-1]], 2)  # [B, W, D]: branch of the parent
    levels = torch.arange(depth, device=dev)
    parents = torch.where(levels[None, None, :] == 0, torch.zeros_like(above), 1 + (levels - 1) * branches + above)
    tokens = torch.where(valid, rows, torch.zeros_like(rows))
    root_parent = torch.full((b, 1), -1, dtype=torch.long, device=dev)
    return (torch.cat([roots[:, None], tokens.transpose(1, 2).reshape(b, -1)], 1),
            torch.cat([root_parent, parents.transpose(1, 2).reshape(b, -1)], 1),
            torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), valid.transpose(1, 2).reshape(b, -1)], 1))


def compact(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """Host-side, for tests and tools: each row's valid nodes in order, as ``(tokens, parents)`` lists with the
    parents renumbered (what ``rule.lookup_tree`` returns for the same rows)."""
    out = []
    for tok, par, ok in zip(tokens.tolist(), parents.tolist(), valid.tolist()):
        keep = [i for i, v in enumerate(ok) if v]
        new = {old: j for j, old in enumerate(keep)}
        out.append(([tok[i] for i in keep], [-1 if par[i] < 0 else new[par[i]] for i in keep]))
    return out
