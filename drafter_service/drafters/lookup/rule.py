"""The lookup tree rule, once, on the host: which looked-up continuations become a tree, and how.

Prompt lookup (n-gram) and retrieval both end with candidate continuations: ``rows`` of up to ``horizon`` tokens
each (shorter where the source ends), each with a priority (n-gram: the length of the match it follows; retrieval:
0). The rule that makes them a tree of ``branches`` continuations of ``depth`` tokens, which the device code
(``device_tree.py``) follows exactly, so a device draft equals the host drafter's tree:

1. ``count(i, d)``: the rows sharing row i's first ``d + 1`` tokens; a row's ``score`` is the sum of its counts over
   its length: how many tokens it would have accepted on average were the true continuation one of the rows.
2. Rows are ranked by ``(priority, score, earlier row first)``.
3. A row whose tokens are a prefix of a better-ranked row's adds nothing (it is redundant); the best ``branches`` of
   the others are the branches, in rank order.
4. The tree is their trie cut to ``depth`` tokens, laid out level by level: node ``(d, w)`` (``d < depth``,
   ``w < branches``) is branch w's token d, present unless an earlier branch has the same first ``d + 1`` tokens (or
   branch w is shorter); its parent is the node of the first branch sharing its first ``d`` tokens.

The host form lists the present nodes in that order (a ``TokenTree``); the device form keeps every ``(d, w)`` slot
and marks the present ones valid.
"""

from __future__ import annotations

from typing import Sequence

from stree.protocols.token_tree import TokenTree


def _prefix_equal(a: Sequence[int], b: Sequence[int], d: int) -> bool:
    """Whether rows ``a`` and ``b`` both have a token ``d`` and agree on their first ``d + 1`` tokens."""
    return d < len(a) and d < len(b) and list(a[: d + 1]) == list(b[: d + 1])


def rank_rows(rows: Sequence[Sequence[int]], priority: Sequence[int], branches: int) -> list[int]:
    """The branches: indices of the best ``branches`` non-redundant rows (rule steps 1-3), best first."""
    k = len(rows)
    score = [sum(sum(1 for j in range(k) if _prefix_equal(rows[i], rows[j], d)) for d in range(len(rows[i])))
             for i in range(k)]
    key = [(priority[i], score[i], -i) for i in range(k)]
    live = [i for i in range(k) if rows[i]]
    kept = [i for i in live
            if not any(j != i and key[j] > key[i] and _prefix_equal(rows[j], rows[i], len(rows[i]) - 1)
                       for j in live)]
    return sorted(kept, key=lambda i: key[i], reverse=True)[:branches]


def lookup_tree(root: int, rows: Sequence[Sequence[int]], priority: Sequence[int], branches: int,
                depth: int) -> TokenTree:
    """The tree the rule makes of ``rows`` (each a list of tokens, empty for none) below ``root``."""
    if branches < 1 or depth < 0:
        raise ValueError(f"lookup tree: need branches >= 1 and depth >= 0, got {branches} and {depth}")
    chosen = [list(rows[i])[:depth] for i in rank_rows(rows, priority, branches)]
    tokens, parents = [int(root)], [-1]
    node_at: dict[tuple[int, int], int] = {}  # (d, w) -> node index, for present nodes
    for d in range(depth):
        for w, row in enumerate(chosen):
            if d >= len(row) or any(_prefix_equal(chosen[v], row, d) for v in range(w)):
                continue
            if d == 0:
                parent = 0
            else:
                rep = next(v for v in range(w + 1) if _prefix_equal(chosen[v], row, d - 1))
                parent = node_at[(d - 1, rep)]
            node_at[(d, w)] = len(tokens)
            tokens.append(int(row[d]))
            parents.append(parent)
    return TokenTree.from_parents(tokens, parents)


def tree_size(budget_nodes: int, budget_depth: int, budget_width: int, most_branches: int) -> tuple[int, int]:
    """``(branches, depth)`` of the largest lookup layout within a draft budget: ``branches`` continuations (at most
    ``most_branches`` and the budget's width) of ``depth`` tokens, ``branches * depth + 1`` nodes at most."""
    branches = max(1, min(most_branches, budget_width, budget_nodes - 1))
    return branches, max(0, min(budget_depth, (budget_nodes - 1) // branches))


def ngram_candidates(context: Sequence[int], min_ngram: int, max_ngram: int, limit: int) -> list[tuple[int, int]]:
    """``(match length, end)`` of the best ``limit`` earlier positions ``end`` (before the last token) whose last
    tokens equal the context's last ones: at least ``min_ngram`` of them (counted up to ``max_ngram``), longest match
    first, then the most recent. Scans the whole context (the reference; sessions keep an index instead)."""
    last = len(context) - 1
    found = []
    for end in range(last):
        m = 0
        while m < max_ngram and end - m >= 0 and context[end - m] == context[last - m]:
            m += 1
        if m >= min_ngram:
            found.append((m, end))
    found.sort(key=lambda me: (-me[0], -me[1]))
    return found[:limit]


def ngram_rows(context: Sequence[int], candidates: Sequence[tuple[int, int]], horizon: int):
    """``(rows, priorities)``: what followed each candidate ``(match length, end)``, up to ``horizon`` tokens and at
    most to the context's last token."""
    rows = [list(context[end + 1: end + 1 + horizon]) for _, end in candidates]
    return rows, [m for m, _ in candidates]


def sample_slots(lo: int, hi: int, limit: int) -> list[int]:
    """The suffix-array slots of ``[lo, hi)`` a retrieval looks at: all of them up to ``limit``, else ``limit``
    spread evenly from ``lo`` to ``hi - 1`` (integer steps, the same on the device)."""
    count = hi - lo
    if count <= limit:
        return list(range(lo, hi))
    return [lo + (i * (count - 1)) // max(limit - 1, 1) for i in range(limit)]


def retrieval_rows(datastore, context: Sequence[int], max_suffix: int, min_suffix: int, limit: int, horizon: int):
    """``(rows, priorities)``: what followed the sampled occurrences of the context's longest suffix (up to
    ``max_suffix`` tokens, at least ``min_suffix``) in ``datastore``, up to ``horizon`` tokens, cut at a document's
    end; rows in suffix-array order, every priority 0."""
    m, lo, hi = datastore.longest_suffix_match(context, max_suffix, min_suffix)
    if m == 0:
        return [], []
    tokens, sa = datastore.tokens, datastore.suffix_array
    rows = []
    for slot in sample_slots(lo, hi, limit):
        start = int(sa[slot]) + m
        row = []
        for t in tokens[start: start + horizon].tolist():
            if t < 0:  # a document's end
                break
            row.append(int(t))
        rows.append(row)
    return rows, [0] * len(rows)
