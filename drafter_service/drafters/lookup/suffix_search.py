"""Suffix-array range search as device code: for B x S queries at once, the slots of every occurrence.

Query ``(b, m)`` is a sequence's last ``m`` tokens; its occurrences in the corpus are the suffix-array slots
``[lower, upper)`` whose suffixes start with it. Both bounds come from one (P+1)-ary search with a fixed number of
rounds: each round compares ``P`` pivot suffixes with the query and keeps the gap where the predicate flips, so
``ceil(log_{P+1} N) + 1`` rounds settle every range of N slots. No host sync, no data-dependent branch.
``Datastore.find`` is the reference (a binary search on the host).
"""

from __future__ import annotations

import torch

PIVOTS = 31
"""Suffixes compared per search per round: a 32-way search needs 6 rounds for 10M corpus tokens."""


def search_rounds(n: int, pivots: int = PIVOTS) -> int:
    """Rounds that settle every range of ``n`` slots: a round leaves at most ``ceil(n / (pivots + 1))`` of them,
    and one more round settles a single slot."""
    rounds = 0
    while n > 1:
        n = -(-n // (pivots + 1))
        rounds += 1
    return rounds + 1


def suffix_ranges(corpus: torch.Tensor, suffix_array: torch.Tensor, queries: torch.Tensor, rounds: int,
                  pivots: int = PIVOTS):
    """``(lower, upper)`` ``[B, S]``: the suffix-array slots of query ``(b, m)`` = ``queries[b, m, :m + 1]``.

    ``corpus``: the datastore's tokens followed by at least S separators (-1), so every pivot reads S tokens;
    ``suffix_array`` ``[N]``; ``queries`` ``[B, S, S]`` (row m: a query of ``m + 1`` tokens, the rest ignored).
    """
    b, s = queries.shape[:2]
    n, dev = suffix_array.shape[0], queries.device
    lo = torch.zeros(b, 2, s, dtype=torch.long, device=dev)
    hi = torch.full((b, 2, s), n, dtype=torch.long, device=dev)
    upper = torch.arange(2, device=dev).bool()[None, :, None, None]  # bound 1 passes suffixes equal to it
    steps = torch.arange(1, pivots + 1, device=dev)
    cols = torch.arange(s, device=dev)
    inside = (cols[None, :] <= cols[:, None])[None, None, :, None, :]  # [1, 1, S, 1, S]: token j of query m
    query = queries[:, None, :, None, :]  # [B, 1, S, 1, S]
    for _ in range(rounds):
        width = hi - lo
        pivot = lo[..., None] + (steps * width[..., None]) // (pivots + 1)  # [B, 2, S, P]
        start = suffix_array[pivot.clamp(max=n - 1)].long()
        head = corpus[start[..., None] + cols]  # [B, 2, S, P, S]
        differ = (head != query) & inside
        first = torch.where(differ, cols, s).amin(-1)  # [B, 2, S, P]: first differing token (S: none)
        at = first.clamp(max=s - 1)[..., None]
        h_tok = head.gather(-1, at)[..., 0]
        q_tok = query.expand_as(head).gather(-1, at)[..., 0]
        less, greater = (first < s) & (h_tok < q_tok), (first < s) & (h_tok > q_tok)
        right = torch.where(upper, ~greater, less)  # the bound lies past this pivot
        below = right.sum(-1)  # [B, 2, S]: pivots before the bound
        new_lo = torch.where(below > 0, pivot.gather(-1, (below - 1).clamp(min=0)[..., None])[..., 0] + 1, lo)
        new_hi = torch.where(below < pivots, pivot.gather(-1, below.clamp(max=pivots - 1)[..., None])[..., 0], hi)
        live = width > 0
        lo, hi = torch.where(live, new_lo, lo), torch.where(live, new_hi, hi)
    return lo[:, 0], lo[:, 1]
