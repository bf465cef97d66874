"""Prompt lookup inside the step graph: each slot's last tokens matched against its own history on the device.

For every earlier position e of a slot's sequence (prompt, output and root), the match length is how many of the
tokens ending at e equal the sequence's last ones, counted up to ``max_ngram``: ``max_ngram`` shifted comparisons of
the whole history at once (``[B, max_ngram, T]``). Positions matching at least ``min_ngram`` tokens are ranked
longest match first, then the most recent (one ``topk``), and the best ``candidates`` of them give their
continuations to the shared tree rule (``rule.py``): the host ``NgramDrafter`` drafts the same trees. Fixed shapes,
no host sync, so the engine captures it in its step graph.
"""

from __future__ import annotations

import torch

from stree.drafter_service.drafters.lookup.device_base import LookupDeviceDrafter
from stree.drafter_service.drafters.lookup.history import NO_TOKEN

NO_MATCH = -2
"""Stands for the tokens before a sequence's start in its suffix: equal to nothing, the history's padding included."""


class NgramDeviceDrafter(LookupDeviceDrafter):
    """The device half of ``NgramDrafter`` (same ``min_ngram``, ``max_ngram`` and ``candidates`` = its
    ``max_scan``)."""

    def __init__(self, shapes: list, min_ngram: int, max_ngram: int, candidates: int, device=None):
        super().__init__(shapes, candidates, device)
        self.min_ngram, self.max_ngram = int(min_ngram), int(max_ngram)
        self.history_pad = self.max_ngram

    def candidates_of(self, horizon: int):
        h = self.history
        g, cap = self.max_ngram, h.capacity
        suffix = h.recent(g)  # [B, G]: the root, then the tokens before it
        suffix = torch.where(suffix == NO_TOKEN, torch.full_like(suffix, NO_MATCH), suffix)
        shifted = torch.stack([h.tokens[:, h.pad - j: h.pad - j + cap] for j in range(g)], 1)  # [B, G, T]
        run = (shifted == suffix[:, :, None]).to(torch.uint8).cumprod(1)
        matched = run.sum(1)  # [B, T]: tokens matched ending at each position, up to max_ngram
        ends = torch.arange(cap, device=h.tokens.device)
        ok = (ends[None, :] < h.length[:, None]) & (matched >= self.min_ngram)
        key = torch.where(ok, matched * cap + ends[None, :], torch.full_like(matched, -1))
        top = torch.topk(key, self.candidates, dim=1)
        end, found = top.indices, top.values >= 0  # [B, K]
        steps = torch.arange(horizon, device=end.device)
        rows = h.gather(end[:, :, None] + 1 + steps)  # [B, K, H]
        lengths = torch.where(found, (h.length[:, None] - end).clamp(max=horizon), torch.zeros_like(end))
        priority = torch.where(found, matched.gather(1, end), torch.zeros_like(end))
        return rows, lengths, priority
