"""Greedy tree verification: the deepest node whose whole path follows the target's argmax.

These tensor functions are the reference for ``greedy_verify_triton`` and the structural pieces
(sibling rank, path, emitted tokens) that ``verifier.decode.verify_device`` also uses for sampled rows.
"""

from __future__ import annotations

import torch

from stree.protocols.token_tree import ancestor_mask

FUSED_MAX_NODES = 64
"""Largest (padded) tree the one-program Triton kernel holds; larger trees take the reference below."""


def sibling_rank(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: how many valid earlier nodes share each node's parent (its rank among siblings)."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    par = parents.clamp_min(0)
    earlier = idx.unsqueeze(0) < idx.unsqueeze(1)  # [i, j]: j < i
    same = (par.unsqueeze(2) == par.unsqueeze(1)) & (valid & (idx > 0)).unsqueeze(1) & earlier
    return same.sum(-1)


def greedy_final(tokens, parents, in_bounds, best, anc, depth):
    """Deepest node whose path follows ``best`` (the argmax after each node; lowest index on ties)."""
    n = tokens.shape[1]
    idx = torch.arange(n, device=tokens.device)
    match = (in_bounds & (tokens == best.gather(1, parents.clamp_min(0)))) | (idx == 0)
    on_path = ~(anc & ~match.unsqueeze(1)).any(-1)
    key = torch.where(on_path, depth * n + (n - 1 - idx), -1)
    return key.argmax(-1)  # keys are distinct: deepest, then lowest index


def path_to(anc, depth, final, max_depth):
    """``[B, max_depth + 1]``: the ancestors of ``final`` ordered by depth, 0 past its depth."""
    n = anc.shape[1]
    rows = torch.arange(anc.shape[0], device=anc.device)
    on = anc[rows, final]  # [B, N]: final's ancestors and itself
    levels = torch.arange(max_depth + 1, device=anc.device)
    at_level = on.unsqueeze(1) & (depth.unsqueeze(1) == levels.view(1, -1, 1))  # [B, D+1, N]
    return (at_level.long() * torch.arange(n, device=anc.device)).sum(-1)


def emitted(tokens, path, path_len, bonus):
    """Tokens of the accepted nodes after the root, then the bonus; 0 after that."""
    on_path = tokens.gather(1, path)
    shifted = torch.cat([on_path[:, 1:], torch.zeros_like(on_path[:, :1])], dim=1)
    k = torch.arange(path.shape[1], device=path.device).unsqueeze(0)
    last = (path_len - 1).unsqueeze(1)
    out = torch.where(k < last, shifted, torch.zeros_like(shifted))
    return torch.where(k == last, bonus.unsqueeze(1), out)


def tree_structure(parents, valid, max_depth, max_width):
    """``(ancestor mask, depth, sibling rank, in_bounds)``: nodes past ``max_depth`` or the first
    ``max_width`` children of their parent are never accepted (as if the tree were truncated)."""
    anc = ancestor_mask(parents)
    depth = anc.sum(-1) - 1
    rank = sibling_rank(parents, valid)
    return anc, depth, rank, valid & (depth <= max_depth) & (rank < max_width)


def greedy_verify_ref(tokens, parents, valid, best, max_depth: int, max_width: int):
    """``(path [B, D+1], path_len [B], bonus [B], out_tokens [B, D+1])`` of greedy verification.

    ``best[b, i]`` is the target's argmax after node i; the contract is ``verify_batch``'s.
    """
    anc, depth, _, in_bounds = tree_structure(parents, valid, max_depth, max_width)
    final = greedy_final(tokens, parents, in_bounds, best, anc, depth)
    bonus = best.gather(1, final.unsqueeze(1)).squeeze(1)
    path = path_to(anc, depth, final, max_depth)
    path_len = depth.gather(1, final.unsqueeze(1)).squeeze(1) + 1
    return path, path_len, bonus, emitted(tokens, path, path_len, bonus)
