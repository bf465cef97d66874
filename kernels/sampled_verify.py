"""Sampled tree verification (recursive rejection sampling) as fixed-shape PyTorch ops: the reference for
``sampled_verify_triton``, and the path for rows with top-k / top-p filters or a float64 law.

One walk per row, level by level: the target's warped law at the current node, its children tried in
order (accept child x w.p. min(1, p(x)/q(x)), else p becomes the residual normalize(max(p - q, 0)); without
replacement, x also leaves q), then the bonus token from the final law by inverse CDF. Greedy rows
(temperature 0) take the deepest node whose path follows the argmax. Nothing reads a value on the host.
"""

from __future__ import annotations

from typing import Optional

import torch
from stree.kernels.greedy_verify import emitted, greedy_final, path_to, tree_structure
from stree.protocols.sampling import sample_inverse_cdf, warp_logits_rows
from stree.protocols.token_tree import DraftMode


def sampled_verify_ref(tokens, parents, valid, logits, temperature, top_k: Optional[torch.Tensor],
                       top_p: Optional[torch.Tensor], mode: DraftMode, draft_probs: Optional[torch.Tensor],
                       uniforms, bonus_uniforms, max_depth: int, max_width: int,
                       prob_dtype: torch.dtype = torch.float32):
    """``(path [B, D+1], path_len [B], bonus [B], out_tokens [B, D+1])``; the contract is ``verify_batch``'s.

    Probabilities are warped in float32 (as ``warp_logits``) and walked in ``prob_dtype`` (float64
    reproduces the CPU reference ``verify.verify_tree`` given the same uniforms exactly).
    """
    mode = DraftMode(mode)
    anc, depth, rank, in_bounds = tree_structure(parents, valid, max_depth, max_width)
    best = logits.argmax(-1)  # [B, N], ties toward the lower token id
    final = greedy_final(tokens, parents, in_bounds, best, anc, depth)
    bonus = best.gather(1, final.unsqueeze(1)).squeeze(1)
    walk = _Walk(tokens, logits, temperature, top_k, top_p, mode, draft_probs, uniforms, prob_dtype)
    kids = _children_table(parents, in_bounds, rank, max_width)
    sampled_node, sampled_bonus = walk.run(kids, bonus_uniforms, max_depth)
    greedy = temperature.to(tokens.device) == 0
    final = torch.where(greedy, final, sampled_node)
    bonus = torch.where(greedy, bonus, sampled_bonus)
    path = path_to(anc, depth, final, max_depth)
    path_len = depth.gather(1, final.unsqueeze(1)).squeeze(1) + 1
    return path, path_len, bonus, emitted(tokens, path, path_len, bonus)


def _children_table(parents, in_bounds, rank, max_width):
    """``[B, N, max_width]``: the r-th child of each node in node order, -1 where none.

    Only non-root nodes with ``in_bounds`` (valid, depth <= max_depth, rank < max_width) are listed.
    """
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    overflow = n * max_width  # one spare slot collects every unlisted node
    listed = in_bounds & (idx > 0)
    slot = torch.where(listed, parents.clamp_min(0) * max_width + rank, overflow)
    table = torch.full((b, overflow + 1), -1, dtype=torch.long, device=parents.device)
    table = table.scatter(1, slot, idx.expand(b, n))
    return table[:, :overflow].reshape(b, n, max_width)


def _normalize(v: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """v / v.sum() per row, or ``fallback`` where that sum is not positive (the reference's rule)."""
    total = v.sum(-1, keepdim=True)
    positive = total > 0
    return torch.where(positive, v / torch.where(positive, total, torch.ones_like(total)), fallback)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)), falling back to p when no mass is left (as in verify._residual)."""
    return _normalize((p - q).clamp_min(0.0), p)


def _remove(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Without replacement: q with token x removed, renormalized (all-zero if nothing is left)."""
    q = q.scatter(1, x.unsqueeze(1), 0.0)
    return _normalize(q, q)


def _accepts(u: torch.Tensor, q_x: torch.Tensor, p_x: torch.Tensor) -> torch.Tensor:
    """Accept w.p. min(1, p(x)/q(x)) given U[0, 1) draws u (module-level so tests can bias it)."""
    return u * q_x < p_x


class _Walk:
    """State of the per-row walk down the trees; every step is tensor ops over ``[B, V]``."""

    def __init__(self, tokens, logits, temperature, top_k, top_p, mode, draft_probs, uniforms, dtype):
        self.tokens, self.logits, self.mode, self.draft_probs = tokens, logits, mode, draft_probs
        self.dtype = dtype
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.uniforms = uniforms.to(dtype)
        self.rows = torch.arange(tokens.shape[0], device=tokens.device)

    def run(self, kids, bonus_uniforms, max_depth):
        """Final node and bonus token of every row (greedy rows get meaningless values here)."""
        node = torch.zeros_like(self.rows)
        done = torch.zeros_like(self.rows, dtype=torch.bool)
        p = None
        for level in range(max_depth + 1):
            fresh = self._target_probs(node)
            p = fresh if p is None else torch.where(done.unsqueeze(1), p, fresh)
            if level == max_depth:
                break  # nodes at max_depth are verified as leaves
            node, done, p = self._try_children(kids, node, done, p)
        u = bonus_uniforms.to(self.dtype)[self.rows, node]
        return node, sample_inverse_cdf(p, u)

    def _target_probs(self, node):
        p = warp_logits_rows(self.logits[self.rows, node], self.temperature, self.top_k, self.top_p)
        p = p.to(self.dtype)
        return p / p.sum(-1, keepdim=True)

    def _draft_probs(self, node):
        if self.mode is DraftMode.DETERMINISTIC:
            return None
        q = self.draft_probs[self.rows, node].to(self.dtype)
        return _normalize(q, q)

    def _try_children(self, kids, node, done, p):
        """Try node's children in order; rows rejecting them all (or at a leaf) are done."""
        q = self._draft_probs(node)
        accepted = torch.full_like(node, -1)
        for rank in range(kids.shape[2]):
            child = kids[self.rows, node, rank]
            live = (child >= 0) & ~done & (accepted < 0)
            c = child.clamp_min(0)
            x = self.tokens[self.rows, c]
            if q is None:
                proposal = torch.zeros_like(p).scatter(1, x.unsqueeze(1), 1.0)  # point mass
            else:
                proposal = q
            q_x = proposal.gather(1, x.unsqueeze(1)).squeeze(1)
            p_x = p.gather(1, x.unsqueeze(1)).squeeze(1)
            tried = live & (q_x > 0)  # q_x <= 0: q could not have drawn x; skip it
            acc = tried & _accepts(self.uniforms[self.rows, c], q_x, p_x)
            rejected = (tried & ~acc).unsqueeze(1)
            accepted = torch.where(acc, child, accepted)
            p = torch.where(rejected, _residual(p, proposal), p)
            if self.mode is DraftMode.WITHOUT_REPLACEMENT:
                q = torch.where(rejected, _remove(q, x), q)
        found = accepted >= 0
        return torch.where(found, accepted, node), done | ~found, p
