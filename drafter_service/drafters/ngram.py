"""N-gram (prompt lookup) drafter: continue the context the way it continued before.

Earlier positions whose last tokens equal the context's last ones (``min_ngram`` up to ``max_ngram`` of them) are
ranked longest match first, then the most recent; what followed the best ``max_scan`` of them are the candidate
continuations, and the shared lookup rule (``lookup/rule.py``) makes them a tree: the most supported continuations,
merged where they share a prefix (as in vLLM's ngram proposer and the n-gram drafter of "Snakes and Ladders", but
several matches at once). The engine drafts the same trees on the device (``device_drafter``: the history of each
sequence on the GPU, matched inside the step graph); the host session, whose n-gram index grows with each commit,
serves the remote drafter service and host engines.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from stree.protocols import DraftBudget, SamplingParams, TokenTree
from stree.protocols.device_drafter import DeviceOffer
from stree.protocols.tree_shape import TreeShape

from stree.drafter_service.drafters.lookup.ngram_device import NgramDeviceDrafter
from stree.drafter_service.drafters.lookup.rule import lookup_tree, ngram_rows, tree_size
from stree.drafter_service.drafters.lookup.shapes import DEFAULT_LOOKUP_TREE, lookup_shapes
from stree.drafter_service.drafters.session import DrafterSession


class NgramDrafter:
    """Prompt-lookup drafter; deterministic, model-free.

    ``max_branches``: most continuations in one host tree; ``max_scan``: candidate matches looked at per draft (the
    best ones). ``lookup_tree``: the device shapes (``auto``: plain decoding, lookup chains and tries by goodput).
    """

    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4, max_branches: int = 8, max_scan: int = 16,
                 lookup_tree: Union[str, TreeShape, None] = DEFAULT_LOOKUP_TREE):
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
        self.shapes = lookup_shapes(lookup_tree)
        self._device: Optional[NgramDeviceDrafter] = None

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "NgramSession":
        return NgramSession(prompt_ids, params, self)

    def device_drafter(self) -> DeviceOffer:
        """Its ``NgramDeviceDrafter`` (one per drafter: the engine holding it keeps its graphs) and shapes."""
        if self._device is None:
            self._device = NgramDeviceDrafter(self.shapes, self.min_ngram, self.max_ngram, self.max_scan)
        return DeviceOffer(self._device, list(self.shapes))


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

    def fork(self) -> "NgramSession":
        """A copy with its own index (its lists grow with its own commits)."""
        other = super().fork()
        other._index = {n: {gram: list(ends) for gram, ends in table.items()} for n, table in self._index.items()}
        return other

    def close(self) -> None:
        super().close()
        self._index = {}
        self._indexed = 0

    def candidates(self) -> list[tuple[int, int]]:
        """``(match length, end)`` of the best ``max_scan`` earlier matches: longest first, then the most recent
        (``rule.ngram_candidates`` from the index)."""
        ctx, last = self.context, len(self.context) - 1
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(min(self.drafter.max_ngram, len(ctx)), self.drafter.min_ngram - 1, -1):
            for end in reversed(self._index[n].get(tuple(ctx[-n:]), ())):
                if end < last and end not in seen:  # an end seen at a longer n matched that many tokens
                    seen.add(end)
                    found.append((n, end))
                    if len(found) >= self.drafter.max_scan:
                        return found
        return found

    def draft(self, budget: DraftBudget) -> TokenTree:
        """The lookup rule's tree of the best matches' continuations, as large as ``budget`` allows."""
        if not self.context:
            raise ValueError("ngram drafter: draft() on a closed session")
        branches, depth = tree_size(budget.max_nodes, budget.max_depth, budget.max_width, self.drafter.max_branches)
        if depth == 0:
            return self.root_only()
        rows, priority = ngram_rows(self.context, self.candidates(), depth)
        return lookup_tree(self.context[-1], rows, priority, branches, depth)
