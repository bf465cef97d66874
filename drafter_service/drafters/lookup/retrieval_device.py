"""Retrieval (REST-style) inside the step graph: the datastore's suffix array on the device, searched per step.

Each slot's last 1..``max_suffix`` tokens are looked up at once (``suffix_search.py``); the longest that occurs
(at least ``min_suffix``) selects its suffix-array range, of which a fixed sample of ``candidates`` occurrences
(all of them when fewer, else spread evenly: ``rule.sample_slots``) gives the continuations the shared tree rule
(``rule.py``) ranks by how often they occur. The host ``RetrievalDrafter`` drafts the same trees.
"""

from __future__ import annotations

import numpy as np
import torch

from stree.drafter_service.drafters.lookup.device_base import LookupDeviceDrafter
from stree.drafter_service.drafters.lookup.suffix_search import PIVOTS, search_rounds, suffix_ranges
from stree.drafter_service.drafters.retrieval.datastore import SEPARATOR, Datastore


class RetrievalDeviceDrafter(LookupDeviceDrafter):
    """The device half of ``RetrievalDrafter`` over ``datastore`` (its corpus and suffix array copied to the
    engine's device once)."""

    def __init__(self, shapes: list, datastore: Datastore, max_suffix: int, min_suffix: int, candidates: int,
                 device=None, pivots: int = PIVOTS):
        super().__init__(shapes, candidates, device)
        self.datastore = datastore
        self.max_suffix, self.min_suffix = int(max_suffix), int(min_suffix)
        self.history_pad = self.max_suffix
        self.pivots = int(pivots)
        self.rounds = search_rounds(len(datastore), self.pivots)
        self._placed = None  # (device, corpus, suffix array)
        depth = max((s.max_depth for s in self.shapes), default=1)
        self._tail = self.max_suffix + depth + 1  # separators after the corpus: every read stays inside

    def on_device(self, device: torch.device) -> None:
        if self._placed is None or self._placed[0] != device:
            tokens = np.asarray(self.datastore.tokens, dtype=np.int64)
            corpus = torch.full((len(tokens) + self._tail,), SEPARATOR, dtype=torch.long)
            corpus[: len(tokens)] = torch.from_numpy(tokens)
            sa = torch.from_numpy(np.asarray(self.datastore.suffix_array, dtype=np.int64))
            self._placed = (device, corpus.to(device), sa.to(device))

    def candidates_of(self, horizon: int):
        h, s, k = self.history, self.max_suffix, self.candidates
        _, corpus, sa = self._placed
        dev = h.tokens.device
        newest = h.recent(s)  # [B, S]: the root, then the tokens before it
        cols = torch.arange(s, device=dev)
        queries = newest[:, (cols[:, None] - cols[None, :]).clamp(min=0)]  # [B, m, j]: token j of the last m + 1
        lower, upper = suffix_ranges(corpus, sa, queries, self.rounds, self.pivots)
        fits = (cols[None, :] + 1) <= (h.length[:, None] + 1)  # the sequence (root included) is that long
        found = (upper > lower) & fits
        best = torch.where(found, cols[None, :], torch.full_like(lower, -1)).amax(1)  # [B]: longest match - 1
        match = best + 1
        at = best.clamp(min=0)[:, None]
        lo, count = lower.gather(1, at)[:, 0], (upper - lower).gather(1, at)[:, 0]
        ok = match >= self.min_suffix  # also False when nothing matched (match 0)
        i = torch.arange(k, device=dev)
        spread = lo[:, None] + (i[None, :] * (count[:, None] - 1)) // max(k - 1, 1)
        slot = torch.where(count[:, None] <= k, lo[:, None] + i[None, :], spread)  # [B, K]
        taken = ok[:, None] & (i[None, :] < count[:, None])
        start = sa[slot.clamp(0, sa.shape[0] - 1)] + match[:, None]
        steps = torch.arange(horizon, device=dev)
        rows = corpus[start[:, :, None] + steps]  # [B, K, H]
        ends = torch.where(rows == SEPARATOR, steps, horizon).amin(-1)  # a document's end cuts the row
        lengths = torch.where(taken, ends, torch.zeros_like(ends))
        return rows.clamp(min=0), lengths, torch.zeros_like(lengths)
