"""Tree verification as device code: batched greedy and recursive rejection sampling, fixed shapes.

No host sync or value-dependent Python branch, so a decode step can be captured in one CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stree.kernels import ops
from stree.kernels.greedy_verify import emitted, greedy_final, path_to, tree_structure
from stree.protocols.sampling import sample_inverse_cdf, warp_logits_rows
from stree.protocols.token_tree import DraftMode, TokenTree


@dataclass
class DeviceVerifyResult:
    """Per-row outcome; every tensor lives on the input's device."""

    path: torch.Tensor  # [B, max_depth + 1] node ids from the root, 0 after path_len
    path_len: torch.Tensor  # [B] accepted nodes including the root (>= 1)
    bonus: torch.Tensor  # [B] the target's token after the last accepted node
    out_tokens: torch.Tensor  # [B, max_depth + 1] accepted tokens after the root, the bonus, then 0
    num_out: torch.Tensor  # [B] emitted tokens (= path_len)


def tree_bounds(trees: Sequence[TokenTree]) -> tuple[int, int]:
    """Host-side helper: (max depth, max children of one node) over ``trees``, for the static bounds."""
    depth = max(t.max_depth for t in trees)
    width = max((max((len(k) for k in t.children()), default=0) for t in trees), default=0)
    return depth, width


def verify_batch(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    mode: DraftMode,
    draft_probs: Optional[torch.Tensor],
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    max_depth: int,
    max_width: int,
    prob_dtype: torch.dtype = torch.float32,
    sampling: bool = True,
) -> DeviceVerifyResult:
    """Verify B padded trees of N nodes at once; rows with ``temperature == 0`` are greedy.

    ``logits[b, i]`` scores the token after node i; ``draft_probs[b, i]`` is the draft law of node
    i's children (needed unless ``mode`` is deterministic). Child i is accepted iff
    ``uniforms[b, i] * q(x_i) < p(x_i)``; the bonus after final node f is
    ``sample_inverse_cdf(residual, bonus_uniforms[b, f])``. Probabilities are warped in float32
    (as ``warp_logits``) and then handled in ``prob_dtype`` (float64 reproduces the CPU reference
    ``verify.verify_tree`` given the same uniforms exactly).

    Contract, not checked on device (that would sync): ``parents[:, 0] == -1``, ``parents[b, i] < i``,
    padding nodes have parent 0 and ``valid`` False, logits give finite distributions, uniforms lie
    in [0, 1). Nodes deeper than ``max_depth`` or past the first ``max_width`` children of their
    parent are never accepted: the same as verifying the truncated tree, so the law stays exact.
    ``sampling=False`` (a static promise that every row is greedy) skips the sampling walk; ``top_k`` /
    ``top_p`` ``None`` (no row filters) skips their sorts in every warp.
    """
    mode = DraftMode(mode)
    _check_shapes(tokens, parents, valid, logits, mode, draft_probs, uniforms, bonus_uniforms,
                  max_depth, max_width)
    if not sampling:  # every row greedy: argmax, then one fused launch on the GPU
        path, path_len, bonus, out = ops.greedy_verify(tokens, parents, valid, logits.argmax(-1),
                                                       max_depth, max_width)
        return DeviceVerifyResult(path=path, path_len=path_len, bonus=bonus, out_tokens=out, num_out=path_len)
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
    out = emitted(tokens, path, path_len, bonus)
    return DeviceVerifyResult(path=path, path_len=path_len, bonus=bonus, out_tokens=out,
                              num_out=path_len)


def _check_shapes(tokens, parents, valid, logits, mode, draft_probs, uniforms, bonus_uniforms,
                  max_depth, max_width) -> None:
    """Static checks only (shapes, Python ints): nothing here reads a tensor's values."""
    if tokens.dim() != 2:
        raise ValueError(f"verify_batch: tokens must be [B, N], got {tuple(tokens.shape)}")
    b, n = tokens.shape
    for name, t in (("parents", parents), ("valid", valid), ("uniforms", uniforms),
                    ("bonus_uniforms", bonus_uniforms)):
        if tuple(t.shape) != (b, n):
            raise ValueError(f"verify_batch: {name} must be [{b}, {n}], got {tuple(t.shape)}")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, n):
        raise ValueError(f"verify_batch: logits must be [{b}, {n}, V], got {tuple(logits.shape)}")
    if mode is not DraftMode.DETERMINISTIC:
        if draft_probs is None:
            raise ValueError(f"verify_batch: mode {mode.value!r} needs draft_probs")
        if tuple(draft_probs.shape) != tuple(logits.shape):
            raise ValueError(
                f"verify_batch: draft_probs must match logits {tuple(logits.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )
    for name, bound in (("max_depth", max_depth), ("max_width", max_width)):
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ValueError(f"verify_batch: {name} must be a Python int >= 0, got {bound!r}")


# ----- tree structure --------------------------------------------------------------------------------
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


# ----- sampling: recursive rejection sampling, one tree level per outer step ------------------------
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
