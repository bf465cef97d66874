"""Best-first pruning of a scored candidate trie down to a ``DraftBudget``.

Model-free drafters and tree fusion all end the same way: a trie of candidate continuations with
a score per node, cut to the budget. Growing from the root and always taking the best-scoring
child of an already kept node keeps parents before children and honours depth and width.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence, Union

from stree.protocols import DraftBudget, TokenTree

Score = Union[float, tuple]


class CandidateTrie:
    """A prefix tree of candidate continuations below one root token (no duplicate siblings)."""

    def __init__(self, root: int):
        self.tokens: list[int] = [int(root)]
        self.parents: list[int] = [-1]
        self._child: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int:
        """The child of ``node`` carrying ``token``, created if missing."""
        key = (node, int(token))
        found = self._child.get(key)
        if found is None:
            found = self._child[key] = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(node)
        return found

    def insert(self, sequence: Sequence[int]) -> list[int]:
        """Add a continuation; returns its node ids from the first token to the last."""
        node, path = 0, []
        for tok in sequence:
            node = self.child(node, tok)
            path.append(node)
        return path


def _score_key(score: Score) -> tuple:
    """A heap key (smaller pops first) for a higher-is-better score (a number or a tuple of numbers)."""
    values = score if isinstance(score, tuple) else (score,)
    key = []
    for v in values:
        v = float(v)
        if math.isnan(v):
            raise ValueError("node scores must not be NaN")
        key.append(-v)
    return tuple(key)


def prune_to_budget(
    tokens: Sequence[int], parents: Sequence[int], scores: Sequence[Score], budget: DraftBudget
) -> TokenTree:
    """Keep the best-scoring nodes of a trie (``parents[i] < i``) that fit ``budget``; BFS order out.

    A node is only taken once its parent is; ties go to the shallower node, then the earlier one.
    The result lists nodes by depth, and within a depth in the order they were taken (best first).
    """
    n = len(tokens)
    if n == 0 or len(parents) != n or len(scores) != n:
        raise ValueError(
            f"prune_to_budget needs equal, non-empty tokens/parents/scores; got {n}/{len(parents)}/{len(scores)}"
        )
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        p = int(parents[i])
        if not 0 <= p < i:
            raise ValueError(f"prune_to_budget: node {i} has parent {p}; parents must come earlier")
        children[p].append(i)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[int(parents[i])] + 1
    keys = [_score_key(s) for s in scores]

    taken = [0]
    width = [0] * n
    heap: list[tuple] = []

    def offer(node: int) -> None:
        if depth[node] < budget.max_depth:
            for c in children[node]:
                heapq.heappush(heap, (keys[c], depth[c], c))

    offer(0)
    while heap and len(taken) < budget.max_nodes:
        _, _, node = heapq.heappop(heap)
        parent = int(parents[node])
        if width[parent] >= budget.max_width:
            continue
        width[parent] += 1
        taken.append(node)
        offer(node)

    order = sorted(range(len(taken)), key=lambda k: (depth[taken[k]], k))
    new_index = {taken[k]: j for j, k in enumerate(order)}
    out_tokens = [int(tokens[taken[k]]) for k in order]
    out_parents = [-1] + [new_index[int(parents[taken[k]])] for k in order[1:]]
    return TokenTree.from_parents(out_tokens, out_parents)
