"""RASD-style fusion scorer: a merged tree's node scores its path's log-probability under the draft model.

Keeps its own draft-model state in step with the context (fed incrementally), so each call costs
one tree pass of the draft model over the merged tree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stree.protocols.token_tree import TokenTree, TreeBatch


class DraftModelScorer:
    def __init__(self, draft_model, max_seqlen: int = 8192):
        self.model = draft_model
        self.max_seqlen = max_seqlen
        self.fed: list[int] = []
        self.state = None

    def _sync(self, prefix: list[int]) -> None:
        """Make the state have fed exactly ``prefix`` (incrementally when it extends what was fed)."""
        dev = self.model.device
        if self.state is None or prefix[: len(self.fed)] != self.fed:
            self.state = self.model.new_state(1, len(prefix) + self.max_seqlen)
            self.fed = []
        delta = prefix[len(self.fed):]
        if delta:
            self.model.prefill(torch.tensor([delta], device=dev), self.state)
            self.fed = list(prefix)

    def __call__(self, context: Sequence[int], tree: TokenTree) -> torch.Tensor:
        self._sync([int(t) for t in context[:-1]])
        logits, _ = self.model.tree_forward(TreeBatch.from_trees([tree]), self.state)
        logp = torch.log_softmax(logits[0].float(), dim=-1).cpu()
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        scores = torch.zeros(tree.num_nodes)
        for i in range(1, tree.num_nodes):
            scores[i] = scores[parents[i]] + logp[parents[i], tokens[i]]
        return scores
