"""Host drafters' trees into the engine's step: each slot's session drafts a ``TokenTree`` on the host, and the
trees are padded into one ``[4, B, N]`` device copy (tokens, parents, depths, valid) per step.

The fallback rule lives here, once: a session that raises, returns an invalid or over-budget tree, or a tree of
another verification mode than the step's, drafts nothing for that step (its slot takes a plain step inside the
same tree pass); a session whose commit raises is replaced by ``DeadSession`` for the rest of its generation. A
drafter can cost speed, never output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stree.protocols.drafter import DraftBudget
from stree.protocols.token_tree import DraftMode, TokenTree
from stree.protocols.tree_shape import TreeShape
from stree.protocols.validate import tree_problem
from stree.verifier.decode.request import Request
from stree.verifier.model.batch_prefill import next_power_of_two

log = logging.getLogger(__name__)


class DeadSession:
    """Stands in for a host drafter session that failed for good: it never drafts."""

    def draft(self, budget: DraftBudget) -> TokenTree:
        raise RuntimeError("drafter is gone")

    def commit(self, tokens: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None


def bucket(nodes: int) -> int:
    """Host trees are padded to a power of two nodes (few graphs, little padding)."""
    return next_power_of_two(nodes)


def draft_or_skip(req: Request, budget: DraftBudget, vocab_size: int) -> Optional[TokenTree]:
    """``req``'s session's tree for this step, or None (a plain step for it) when the session fails or the tree
    is unusable; counts and logs the fallback on the request."""
    try:
        tree = req.drafter_session.draft(budget)
        why = tree_problem(tree, req.root_token, budget, vocab_size)
    except Exception as exc:  # noqa: BLE001 - a broken drafter costs speed, never output
        why = f"drafter failed: {exc!r}"
    if why is None:
        return tree
    req.drafter_fallbacks += 1
    if req.drafter_fallbacks <= 3 or req.drafter_fallbacks % 100 == 0:  # a dead drafter must not flood the log
        log.warning("drafter skipped for this step (%d so far): %s", req.drafter_fallbacks, why)
    return None


def commit_or_drop(req: Request, new: list[int]) -> None:
    """Tell ``req``'s session what was accepted; a session that fails here is dropped for good."""
    try:
        req.drafter_session.commit(new)
    except Exception as exc:  # noqa: BLE001
        log.warning("drafter commit failed (%r); continuing without the drafter", exc)
        req.drafter_session = DeadSession()


def close_quietly(req: Request) -> None:
    try:
        req.drafter_session.close()
    except Exception as exc:  # noqa: BLE001 - a plugin's close must not stop the engine
        log.warning("drafter close failed: %r", exc)


@dataclass
class StagedTrees:
    """One step's host trees on the device: ``shape`` (the node bucket), their verification ``mode``, whether draft
    laws came (``with_q``) and how many nodes were drafted below the roots in all."""

    shape: TreeShape
    mode: DraftMode
    with_q: bool
    drafted: int


class HostTrees:
    """The device buffers host trees are staged into, for ``batch`` slots of up to ``max_nodes`` nodes."""

    def __init__(self, batch: int, max_nodes: int, budget: DraftBudget, vocab_size: int, device):
        self.batch, self.budget, self.vocab_size, self.device = batch, budget, vocab_size, device
        self.trees = torch.zeros(4, batch, max_nodes, dtype=torch.long, device=device)
        self.q: Optional[torch.Tensor] = None  # [B, N, V] draft laws of sampled stochastic trees

    def stage(self, slots: list, any_sampled: bool) -> StagedTrees:
        """Ask every running slot's session for a tree and copy them, padded, to the device (between steps)."""
        trees: list[Optional[TokenTree]] = [None] * self.batch
        mode = None
        for i, req in enumerate(slots):
            if req is None:
                continue
            tree = draft_or_skip(req, self.budget, self.vocab_size)
            if tree is not None and tree.num_nodes > 1:
                mode = mode or tree.mode
                if tree.mode is not mode:
                    tree = None  # one verification rule per step; a tree of another kind waits its turn
            trees[i] = tree
        n = bucket(max(t.num_nodes if t is not None else 1 for t in trees))
        # greedy rows verify by argmax alone: a sampled tree's draft_probs play no part in them
        mode = (mode if any_sampled else None) or DraftMode.DETERMINISTIC
        with_q = any_sampled and mode is not DraftMode.DETERMINISTIC
        packed = torch.zeros(4, self.batch, n, dtype=torch.long)
        packed[2] = 1  # padding nodes: children of the root, never valid
        q = torch.zeros(self.batch, n, self.vocab_size) if with_q else None
        total = 0
        for i, (req, tree) in enumerate(zip(slots, trees)):
            packed[:, i, 0] = torch.tensor([req.root_token if req is not None else 0, -1, 0, 1])
            if req is not None:
                req.host_drafted = 0
            if tree is None:
                continue
            m = tree.num_nodes
            packed[0, i, :m], packed[1, i, :m], packed[2, i, :m], packed[3, i, :m] = (
                tree.tokens, tree.parents, tree.depth, 1)
            req.host_drafted = m - 1
            total += m - 1
            if with_q and tree.draft_probs is not None:
                q[i, :m] = tree.draft_probs
        self.trees[:, :, :n].copy_(packed.to(self.device))
        if with_q:
            if self.q is None or self.q.shape != q.shape:
                self.q = torch.zeros(q.shape, device=self.device)
            self.q.copy_(q)
        return StagedTrees(TreeShape("host", nodes=n), mode, with_q, total)

    def view(self, shape: TreeShape):
        """``(tokens, parents, depth, valid)`` ``[B, N]`` of the trees staged for ``shape``'s bucket."""
        tokens, parents, depth, valid = self.trees[:, :, : shape.nodes]
        return tokens, parents, depth, valid.bool()

