"""Retrieval drafter (REST-style): draft what most often followed the context's suffix in a corpus.

The longest context suffix found in the ``Datastore`` (up to ``max_suffix`` tokens) selects its
occurrences; their continuations are counted in a trie, and the most frequent ones become the
tree, grown best-first by frequency within the step's budget.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np

from stree.protocols import DraftBudget, HostDrafter, SamplingParams, TokenTree

from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.drafter_service.drafters.session import DrafterSession
from stree.drafter_service.drafters.tree_prune import CandidateTrie, prune_to_budget


class RetrievalDrafter(HostDrafter):
    """Deterministic, model-free drafter over a suffix-array ``Datastore``."""

    name = "retrieval"

    def __init__(self, datastore: Union[Datastore, str, os.PathLike], max_suffix: int = 16,
                 min_suffix: int = 1, max_occurrences: int = 5000, vocab_size: Optional[int] = None):
        if isinstance(datastore, (str, os.PathLike)):
            datastore = Datastore.load(datastore, vocab_size=vocab_size)
        if not isinstance(datastore, Datastore):
            raise ValueError(
                f"retrieval drafter: datastore must be a path or a Datastore, got {type(datastore).__name__}"
            )
        if int(min_suffix) < 1 or int(max_suffix) < int(min_suffix):
            raise ValueError(
                f"retrieval drafter: need 1 <= min_suffix <= max_suffix, got {min_suffix} and {max_suffix}"
            )
        if int(max_occurrences) < 1:
            raise ValueError(f"retrieval drafter: max_occurrences must be >= 1, got {max_occurrences}")
        self.datastore = datastore
        self.max_suffix = int(max_suffix)
        self.min_suffix = int(min_suffix)
        self.max_occurrences = int(max_occurrences)

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "RetrievalSession":
        return RetrievalSession(prompt_ids, params, self)


class RetrievalSession(DrafterSession):
    """A context list; each draft looks its suffix up in the shared datastore."""

    def draft(self, budget: DraftBudget) -> TokenTree:
        """The most frequent continuations of the longest matching suffix, best-first under ``budget``."""
        if not self.context:
            raise ValueError("retrieval drafter: draft() on a closed session")
        if budget.max_nodes == 1 or budget.max_depth == 0:
            return self.root_only()
        d = self.drafter
        depth = min(budget.max_depth, budget.max_nodes - 1)  # no path can be longer
        rows = d.datastore.continuations(self.context, depth, d.max_suffix, d.min_suffix, d.max_occurrences)
        if len(rows) == 0:
            return self.root_only()
        distinct, counts = np.unique(rows, axis=0, return_counts=True)
        trie = CandidateTrie(self.context[-1])
        frequency = [0.0]
        for row, count in zip(distinct.tolist(), counts.tolist()):
            length = row.index(-1) if -1 in row else len(row)
            for node in trie.insert(row[:length]):
                if node == len(frequency):
                    frequency.append(0.0)
                frequency[node] += count
        return prune_to_budget(trie.tokens, trie.parents, frequency, budget)
