"""Lossless verification of a drafted token tree against the target's logits (greedy and sampling).

Greedy keeps the deepest path on which every token is the target's argmax. Sampling walks down
the tree with recursive rejection sampling, so the emitted tokens are distributed exactly as if
the target had sampled them alone (SpecInfer multi-step speculative sampling; the
without-replacement rule of Sequoia / Recursive Speculative Decoding; point masses for
deterministic drafters). Sampling arithmetic runs on small CPU float64 vectors, whatever device
the logits live on, so the result is exact up to float64 rounding and device-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Optional

import torch

from stree.protocols.sampling import SamplingParams, sample_inverse_cdf, warp_logits
from stree.protocols.token_tree import DraftMode, TokenTree


@dataclass
class VerifyResult:
    """Accepted node indices from the root (root first) and the target's bonus token after them."""

    path: list[int]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (the root is not counted)."""
        return len(self.path) - 1

    def accepted_tokens(self, tree: TokenTree) -> list[int]:
        """Tokens emitted this step: those of the accepted nodes after the root, then the bonus."""
        tokens = tree.tokens.tolist()
        return [tokens[i] for i in self.path[1:]] + [self.bonus_token]


def verify_tree(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: Optional[torch.Generator] = None,
    *,
    uniforms: Optional[torch.Tensor] = None,
    bonus_uniforms: Optional[torch.Tensor] = None,
) -> VerifyResult:
    """Pick the accepted path of ``tree`` and the bonus token; ``target_logits[i]`` scores the token after node i.

    All randomness comes from ``generator`` (a CPU ``torch.Generator``; None uses torch's global RNG),
    unless explicit U[0, 1) draws are given (1-D, one per node, as the device verifier takes them):
    child i is accepted iff ``uniforms[i] * q(x_i) < p(x_i)``, and the bonus after final node f is
    ``sample_inverse_cdf(residual, bonus_uniforms[f])``. Greedy params ignore all randomness.
    """
    _check_inputs(tree, target_logits, params, generator)
    _check_uniforms(tree, uniforms, bonus_uniforms)
    if params.greedy:
        return _verify_greedy(tree, target_logits)
    draws = _Draws(generator, uniforms, bonus_uniforms)
    return _verify_sampling(tree, target_logits, params, draws)


def _check_inputs(tree, target_logits, params, generator) -> None:
    if not isinstance(tree, TokenTree):
        raise ValueError(f"verify_tree: tree must be a TokenTree, got {type(tree).__name__}")
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        shape = tuple(target_logits.shape) if isinstance(target_logits, torch.Tensor) else None
        raise ValueError(f"verify_tree: target_logits must be a 2-D tensor [nodes, vocab], got {shape}")
    rows, vocab = target_logits.shape
    if rows != tree.num_nodes:
        raise ValueError(
            f"verify_tree: target_logits has {rows} rows but the tree has {tree.num_nodes} nodes"
        )
    if vocab == 0:
        raise ValueError("verify_tree: target_logits has an empty vocabulary dimension")
    tree.check_vocab(vocab)
    sampling_needs_q = not params.greedy and tree.mode is not DraftMode.DETERMINISTIC
    if sampling_needs_q and tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab:
        raise ValueError(
            f"verify_tree: draft_probs has vocabulary {tree.draft_probs.shape[1]} but "
            f"target_logits has {vocab}"
        )
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"verify_tree: generator must be a CPU torch.Generator, got {generator.device}")


def _check_uniforms(tree, uniforms, bonus_uniforms) -> None:
    for name, u in (("uniforms", uniforms), ("bonus_uniforms", bonus_uniforms)):
        if u is not None and (not isinstance(u, torch.Tensor) or tuple(u.shape) != (tree.num_nodes,)):
            shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(
                f"verify_tree: {name} must be a 1-D tensor of {tree.num_nodes} draws, got {shape}"
            )


@dataclass
class _Draws:
    """Where the sampling walk's randomness comes from: the generator, or explicit per-node uniforms."""

    generator: Optional[torch.Generator]
    uniforms: Optional[torch.Tensor]
    bonus_uniforms: Optional[torch.Tensor]

    def accept_u(self, child: int) -> float:
        if self.uniforms is None:
            return _uniform(self.generator)
        return float(self.uniforms[child])

    def bonus(self, p: torch.Tensor, node: int) -> int:
        if self.bonus_uniforms is None:
            return int(torch.multinomial(p, 1, generator=self.generator))
        return int(sample_inverse_cdf(p, self.bonus_uniforms[node]))


def _verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> VerifyResult:
    """Deepest node whose every token is its parent's argmax (first such node on ties); bonus = its argmax.

    Taking the deepest matching node (not the first matching child) also handles duplicate sibling tokens.
    """
    best = target_logits.argmax(-1).tolist()
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    on_path = [True] + [False] * (tree.num_nodes - 1)
    deepest = 0
    for i in range(1, tree.num_nodes):
        on_path[i] = on_path[parents[i]] and tokens[i] == best[parents[i]]
        if on_path[i] and depth[i] > depth[deepest]:
            deepest = i
    return VerifyResult(path=tree.path(deepest), bonus_token=best[deepest])


def _verify_sampling(tree, target_logits, params, draws: _Draws) -> VerifyResult:
    """Walk down the tree, trying each node's children in node order by recursive rejection sampling.

    deterministic: q = delta_x; accept w.p. p(x), else p <- normalize(max(p - delta_x, 0)).
    iid (SpecInfer): accept w.p. min(1, p(x)/q(x)), else p <- normalize(max(p - q, 0)); q stays.
    without_replacement: as iid, then q <- normalize(q with x removed), the law of the next child.
    All children rejected (or a leaf): the bonus token is drawn from the current residual p.
    """
    tokens, children = tree.tokens.tolist(), tree.children()
    vocab = target_logits.shape[1]
    mode = tree.mode
    path, node = [0], 0
    while True:
        p = _target_probs(target_logits[node], params, node)
        drafted = mode is not DraftMode.DETERMINISTIC and children[node]
        q = _draft_probs(tree, node) if drafted else None
        accepted = None
        for child in children[node]:
            x = tokens[child]
            proposal = _point_mass(x, vocab) if q is None else q
            q_x, p_x = float(proposal[x]), float(p[x])
            if q_x <= 0:
                # Off-contract: q could never have drawn x. Skipping it is the same as verifying the
                # tree without it, so the output law stays exact.
                continue
            if draws.accept_u(child) * q_x < p_x:  # accept w.p. min(1, p(x)/q(x))
                accepted = child
                break
            p = _residual(p, proposal)
            if mode is DraftMode.WITHOUT_REPLACEMENT:
                q = _remove(q, x)
        if accepted is None:
            bonus = draws.bonus(p, node)
            return VerifyResult(path=path, bonus_token=bonus)
        path.append(accepted)
        node = accepted


def _target_probs(logits_row: torch.Tensor, params: SamplingParams, node: int) -> torch.Tensor:
    """Target distribution after node (the shared warp), as a normalized CPU float64 vector."""
    p = warp_logits(logits_row, params).to("cpu", torch.float64)
    total = float(p.sum())  # NaN/inf logits make the sum non-finite
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"verify_tree: target logits of node {node} give no valid distribution")
    return p / total


def _draft_probs(tree: TokenTree, node: int) -> torch.Tensor:
    """Draft distribution q over node's children (CPU float64, renormalized; all-zero if it has no mass)."""
    if tree.draft_probs is None:
        raise ValueError(f"verify_tree: mode {tree.mode.value!r} needs the tree's draft_probs")
    q = tree.draft_probs[node].to("cpu", torch.float64)
    total = float(q.sum())
    if not math.isfinite(total) or float(q.min()) < 0:
        raise ValueError(f"verify_tree: draft_probs of node {node} must be finite and >= 0")
    return q / total if total > 0 else q


def _point_mass(token: int, vocab: int) -> torch.Tensor:
    """q = delta_token: how a deterministic child is verified (accept w.p. p(token))."""
    q = torch.zeros(vocab, dtype=torch.float64)
    q[token] = 1.0
    return q


def _uniform(generator: Optional[torch.Generator]) -> float:
    """One U[0, 1) draw; with u < 1, p(x) >= q(x) always accepts and p(x) = 0 never does."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)): the target mass a rejected proposal from q still owes.

    Rejection implies p(x) < q(x), hence a positive residual in exact arithmetic; if rounding
    leaves zero mass, rejection had probability ~0 and keeping p is as good as any choice.
    """
    r = (p - q).clamp_min(0.0)
    total = float(r.sum())
    return r / total if total > 0 else p


def _remove(q: torch.Tensor, token: int) -> torch.Tensor:
    """Without replacement: the next child is drawn from q with ``token`` removed and renormalized.

    If nothing is left, q becomes all-zero and any further child is skipped (it could not be drawn).
    """
    q = q.clone()
    q[token] = 0.0
    total = float(q.sum())
    return q / total if total > 0 else q
