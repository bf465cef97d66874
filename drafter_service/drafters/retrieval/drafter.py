"""Retrieval drafter (REST-style): draft what most often followed the context's suffix in a corpus.

The longest context suffix found in the ``Datastore`` (up to ``max_suffix`` tokens) selects its occurrences; a fixed
sample of them (``max_occurrences``, spread evenly over all) gives candidate continuations, and the shared lookup
rule (``lookup/rule.py``) makes them a tree: the continuations most occurrences agree with, merged where they share a
prefix. The engine drafts the same trees on the device (``device_drafter``: the suffix array on the GPU, searched
inside the step graph); the host session serves the remote drafter service and host engines.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from stree.protocols import DraftBudget, SamplingParams, TokenTree
from stree.protocols.device_drafter import DeviceOffer
from stree.protocols.tree_shape import TreeShape

from stree.drafter_service.drafters.lookup.retrieval_device import RetrievalDeviceDrafter
from stree.drafter_service.drafters.lookup.rule import lookup_tree, retrieval_rows, tree_size
from stree.drafter_service.drafters.lookup.shapes import DEFAULT_LOOKUP_TREE, lookup_shapes
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.drafter_service.drafters.session import DrafterSession


class RetrievalDrafter:
    """Deterministic, model-free drafter over a suffix-array ``Datastore``.

    ``max_occurrences``: corpus occurrences of the matched suffix counted per draft; ``max_branches``: most
    continuations in one host tree; ``lookup_tree``: the device shapes (``auto``: plain decoding, chains and tries).
    """

    name = "retrieval"

    def __init__(self, datastore: Union[Datastore, str, os.PathLike], max_suffix: int = 16,
                 min_suffix: int = 1, max_occurrences: int = 64, vocab_size: Optional[int] = None,
                 max_branches: int = 8, lookup_tree: Union[str, TreeShape, None] = DEFAULT_LOOKUP_TREE):
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
        if int(max_branches) < 1:
            raise ValueError(f"retrieval drafter: max_branches must be >= 1, got {max_branches}")
        self.datastore = datastore
        self.max_suffix = int(max_suffix)
        self.min_suffix = int(min_suffix)
        self.max_occurrences = int(max_occurrences)
        self.max_branches = int(max_branches)
        self.shapes = lookup_shapes(lookup_tree)
        self._device: Optional[RetrievalDeviceDrafter] = None

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "RetrievalSession":
        return RetrievalSession(prompt_ids, params, self)

    def device_drafter(self) -> DeviceOffer:
        """Its ``RetrievalDeviceDrafter`` (one per drafter: the engine holding it keeps its graphs) and shapes."""
        if self._device is None:
            self._device = RetrievalDeviceDrafter(self.shapes, self.datastore, self.max_suffix, self.min_suffix,
                                                  self.max_occurrences)
        return DeviceOffer(self._device, list(self.shapes))


class RetrievalSession(DrafterSession):
    """A context list; each draft looks its suffix up in the shared datastore."""

    def draft(self, budget: DraftBudget) -> TokenTree:
        """The lookup rule's tree of the sampled occurrences' continuations, as large as ``budget`` allows."""
        if not self.context:
            raise ValueError("retrieval drafter: draft() on a closed session")
        d = self.drafter
        branches, depth = tree_size(budget.max_nodes, budget.max_depth, budget.max_width, d.max_branches)
        if depth == 0:
            return self.root_only()
        rows, priority = retrieval_rows(d.datastore, self.context, d.max_suffix, d.min_suffix, d.max_occurrences,
                                        depth)
        return lookup_tree(self.context[-1], rows, priority, branches, depth)
