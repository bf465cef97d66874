"""Tree fusion: merge several deterministic drafters' trees into one prefix tree under a budget.

Each node of the merged tree is scored (by default: how many source trees contain its path; or a
pluggable ``scorer``, e.g. a draft model's log-probabilities as in RASD) and the best-scoring
nodes that fit the budget are kept. Only deterministic trees can be merged: children drawn by
sampling carry draft probabilities whose rejection rule a union would break.

A draft model beside a lookup drafter (``fusion:mamba+ngram``, ``fusion:mamba+retrieval``) fuses on the
device instead (``device_drafter``: ``device_fusion.py``), inside the engine's step graph: every node of
both trees is kept (the fused shape's node count is fixed), so no scorer is needed there.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from stree.protocols import (
    MAX_TREE_NODES,
    ContextSession,
    DraftBudget,
    Drafter,
    DraftMode,
    SamplingParams,
    TokenTree,
)

from stree.drafter_service.drafters.fusion.device_fusion import CompositeDeviceDrafter, composite_shapes
from stree.drafter_service.drafters.lookup.device_base import LookupDeviceDrafter
from stree.drafter_service.drafters.tree_prune import CandidateTrie, prune_to_budget
from stree.protocols.device_drafter import DeviceOffer

log = logging.getLogger(__name__)

TreeScores = Callable[[TokenTree], torch.Tensor]
"""Per-node scores (higher is better, shape ``[N]``) of a merged tree."""

Scorer = Callable[[list, TokenTree], torch.Tensor]
"""``scorer(context, tree) -> [N]`` per-node log-scores, e.g. a draft model's path log-probabilities."""


def merge_trees(trees: Sequence[TokenTree], budget: DraftBudget, scores: Optional[TreeScores] = None) -> TokenTree:
    """Union of ``trees`` (same root token) pruned best-first to ``budget``.

    ``scores(union)`` gives per-node scores; by default a node scores the number of source trees
    that contain its path. Ties go to shallower nodes, then to earlier trees' nodes.
    """
    if not trees:
        raise ValueError("merge_trees: need at least one tree")
    root = int(trees[0].tokens[0])
    for k, tree in enumerate(trees):
        if tree.mode is not DraftMode.DETERMINISTIC:
            raise ValueError(
                f"merge_trees: tree {k} was drafted in {tree.mode.value!r} mode; fusion only merges "
                "deterministic trees (sampled children cannot be losslessly verified after a union)"
            )
        if int(tree.tokens[0]) != root:
            raise ValueError(f"merge_trees: tree {k} has root token {int(tree.tokens[0])}, tree 0 has {root}")
    trie = CandidateTrie(root)
    support = [float(len(trees))]
    for tree in trees:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        mapped = [0] * len(tokens)
        for i in range(1, len(tokens)):
            mapped[i] = trie.child(mapped[parents[i]], tokens[i])
            if mapped[i] == len(support):
                support.append(0.0)
        for node in set(mapped[1:]):
            support[node] += 1.0
    if scores is None:
        return prune_to_budget(trie.tokens, trie.parents, support, budget)
    tokens, parents = trie.tokens, trie.parents
    if len(tokens) > MAX_TREE_NODES:  # too big for one TokenTree: keep the best-supported part
        wide = DraftBudget(max_nodes=MAX_TREE_NODES, max_depth=budget.max_depth, max_width=MAX_TREE_NODES)
        cut = prune_to_budget(tokens, parents, support, wide)
        tokens, parents = cut.tokens.tolist(), cut.parents.tolist()
    union = TokenTree.from_parents(tokens, parents)
    node_scores = torch.as_tensor(scores(union)).detach().float().cpu()
    if node_scores.shape != (union.num_nodes,):
        raise ValueError(
            f"merge_trees: scores must have shape [{union.num_nodes}] (one per node), got {tuple(node_scores.shape)}"
        )
    if bool(torch.isnan(node_scores).any()):
        raise ValueError("merge_trees: scores contain NaN")
    return prune_to_budget(tokens, parents, node_scores.tolist(), budget)


class FusionDrafter:
    """Runs several deterministic drafters side by side and merges their trees each step.

    ``scorer(context, tree) -> [N]`` per-node log-scores replaces the default agreement count.
    """

    def __init__(self, drafters: Sequence[Drafter], scorer: Optional[Scorer] = None):
        drafters = list(drafters)
        if not drafters:
            raise ValueError("fusion drafter: need at least one drafter")
        for d in drafters:
            if not callable(getattr(d, "open", None)):
                raise ValueError(f"fusion drafter: {d!r} is not a Drafter (it has no open())")
        if scorer is not None and not callable(scorer):
            raise ValueError("fusion drafter: scorer must be callable as scorer(context, tree)")
        self.drafters = drafters
        self.scorer = scorer
        self.name = "+".join(str(getattr(d, "name", type(d).__name__)) for d in drafters)
        self._device: Optional[CompositeDeviceDrafter] = None

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "FusionSession":
        return FusionSession(prompt_ids, params, self)

    def device_drafter(self) -> Optional[DeviceOffer]:
        """A draft model's device drafter and a lookup one, fused on the device (``composite_shapes``), or None:
        other members, or a model shape that cannot be fused there, fuse on the host."""
        if len(self.drafters) != 2:
            return None
        offers = [d.device_drafter() for d in self.drafters]
        if any(o is None for o in offers):
            return None
        lookups = [o for o in offers if isinstance(o.drafter, LookupDeviceDrafter)]
        models = [o for o in offers if not isinstance(o.drafter, LookupDeviceDrafter)]
        if len(lookups) != 1 or len(models) != 1 or not models[0].drafter.follows_trees:
            return None
        shapes = composite_shapes(models[0].shapes, lookups[0].shapes)
        if not shapes:
            return None
        if self._device is None:  # one per drafter: the engine holding it keeps its graphs
            self._device = CompositeDeviceDrafter(models[0].drafter, lookups[0].drafter, shapes)
        return DeviceOffer(self._device, list(self._device.shapes))


class FusionSession(ContextSession):
    """Sub-sessions of every drafter; a sub-drafter that fails is skipped, never fatal."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, drafter: FusionDrafter):
        super().__init__(prompt_ids, params)
        self.scorer = drafter.scorer
        self.subs: list[tuple[str, object]] = []
        try:
            for d in drafter.drafters:
                self.subs.append((str(getattr(d, "name", type(d).__name__)), d.open(list(self.context), params)))
        except BaseException:
            self.close()
            raise

    def _sub_tree(self, name: str, session, budget: DraftBudget) -> Optional[TokenTree]:
        try:
            tree = session.draft(budget)
        except Exception as exc:
            log.warning("fusion: drafter %s failed to draft (%s); skipping it this step", name, exc)
            return None
        if not isinstance(tree, TokenTree):
            log.warning("fusion: drafter %s returned %s, not a TokenTree; skipping it", name, type(tree).__name__)
            return None
        if tree.mode is not DraftMode.DETERMINISTIC:
            raise ValueError(
                f"fusion: drafter {name} drafts in {tree.mode.value!r} mode; fusion only merges "
                "deterministic trees (sampling-mode drafts cannot be losslessly merged)"
            )
        why = budget.violation(tree)
        if why is None and int(tree.tokens[0]) != self.context[-1]:
            why = f"root token {int(tree.tokens[0])} is not the last context token {self.context[-1]}"
        if why is not None:
            log.warning("fusion: drafter %s returned an unusable tree (%s); skipping it", name, why)
            return None
        return tree

    def draft(self, budget: DraftBudget) -> TokenTree:
        if not self.context:
            raise ValueError("fusion drafter: draft() on a closed session")
        trees = [t for name, s in self.subs if (t := self._sub_tree(name, s, budget)) is not None]
        if not trees:
            return self.root_only()
        scores = None
        if self.scorer is not None:
            context = list(self.context)
            scores = lambda tree: self.scorer(context, tree)  # noqa: E731
        return merge_trees(trees, budget, scores)

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        super().commit(tokens)
        kept = []
        for name, session in self.subs:
            try:
                session.commit(tokens)
                kept.append((name, session))
            except Exception as exc:  # its context is now out of step: drop it for this generation
                log.warning("fusion: drafter %s failed to commit (%s); dropping it from this session", name, exc)
        self.subs = kept

    def close(self) -> None:
        for name, session in self.subs:
            try:
                session.close()
            except Exception as exc:
                log.warning("fusion: drafter %s failed to close (%s)", name, exc)
        self.subs = []
        super().close()
