"""N-gram (prompt lookup) drafter: continue the context the way it continued before.

The longest recent suffix of the context (``max_ngram`` tokens down to ``min_ngram``) is looked
up among earlier positions; what followed each earlier occurrence becomes a branch of the tree
(as in vLLM's ngram proposer and the n-gram drafter of "Snakes and Ladders", but several matches
at once). The n-gram index grows with each commit, so a step costs O(new tokens), not a rescan.
"""

from __future__ import annotations

from typing import Sequence

from stree.protocols import DraftBudget, HostDrafter, SamplingParams, TokenTree

from stree.drafter_service.drafters.session import DrafterSession
from stree.drafter_service.drafters.tree_prune import CandidateTrie, prune_to_budget


class NgramDrafter(HostDrafter):
    """Prompt-lookup drafter; deterministic, model-free.

    ``max_branches``: most distinct continuations merged into one tree; ``max_scan``: most earlier
    occurrences of one n-gram looked at per step (the most recent ones).
    """

    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, max_branches: int = 8, max_scan: int = 64):
        self.min_ngram, self.max_ngram = int(min_ngram), int(max_ngram)
        self.max_branches, self.max_scan = int(max_branches), int(max_scan)
        if self.min_ngram < 1:
            raise ValueError(f"ngram drafter: min_ngram must be >= 1, got {min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"ngram drafter: max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")
        if self.max_branches < 1 or self.max_scan < 1:
            raise ValueError(
                f"ngram drafter: max_branches and max_scan must be >= 1, got {max_branches} and {max_scan}"
            )

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "NgramSession":
        return NgramSession(prompt_ids, params, self)


class NgramSession(DrafterSession):
    """One generation's context plus, per n, a map from each n-gram to the positions where it ends."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, drafter: NgramDrafter):
        super().__init__(prompt_ids, params, drafter)
        self._index: dict[int, dict[tuple, list[int]]] = {
            n: {} for n in range(drafter.min_ngram, drafter.max_ngram + 1)
        }
        self._indexed = 0
        self._extend_index()

    def _extend_index(self) -> None:
        ctx = self.context
        for end in range(self._indexed, len(ctx)):
            for n, table in self._index.items():
                if end + 1 >= n:
                    table.setdefault(tuple(ctx[end + 1 - n : end + 1]), []).append(end)
        self._indexed = len(ctx)

    def commit(self, tokens: Sequence[int]) -> None:
        super().commit(tokens)
        self._extend_index()

    def close(self) -> None:
        super().close()
        self._index = {}
        self._indexed = 0

    def draft(self, budget: DraftBudget) -> TokenTree:
        """Branches from the most recent matches of the longest matching suffix first, cut to ``budget``."""
        if not self.context:
            raise ValueError("ngram drafter: draft() on a closed session")
        ctx, last = self.context, len(self.context) - 1
        if budget.max_nodes == 1 or budget.max_depth == 0:
            return self.root_only()
        trie = CandidateTrie(ctx[-1])
        best_n, support, first_rank = [0], [0], [0]  # per trie node; the root's values are unused
        branches, seen = 0, set()
        limit = self.drafter.max_branches
        depth = min(budget.max_depth, budget.max_nodes - 1)  # no path can be longer
        for n in range(min(self.drafter.max_ngram, len(ctx)), self.drafter.min_ngram - 1, -1):
            ends = self._index[n].get(tuple(ctx[-n:]), ())
            scanned = 0
            for end in reversed(ends):
                if end >= last:
                    continue  # the suffix itself
                scanned += 1
                continuation = tuple(ctx[end + 1 : end + 1 + depth])
                is_new = continuation not in seen
                seen.add(continuation)
                rank = branches if is_new else len(ctx)  # repeats add support, not a new branch
                for node in trie.insert(continuation):
                    if node == len(best_n):
                        best_n.append(n)
                        support.append(0)
                        first_rank.append(rank)
                    support[node] += 1
                    first_rank[node] = min(first_rank[node], rank)
                branches += is_new
                if branches >= limit or scanned >= self.drafter.max_scan:
                    break
            if branches >= limit:
                break
        if len(trie) == 1:
            return self.root_only()
        scores = [(best_n[i], support[i], -first_rank[i]) for i in range(len(trie))]
        return prune_to_budget(trie.tokens, trie.parents, scores, budget)
