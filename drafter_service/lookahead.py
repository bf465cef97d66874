"""Drafting ahead: trees for the likeliest outcomes of the tree the verifier is verifying now.

While the verifier verifies tree t the drafter would sit idle. Instead, on forks of the session
(``ForkableSession``), it drafts the tree that comes next if a hypothesis about t's outcome holds. A hypothesis is
what the verifier would then commit: the path from t's root to one of its leaves, accepted whole, then the token the
target adds after it, guessed as the drafter's own likeliest tokens there (a one-level draft from the leaf). Leaves
are taken deepest first, in node order among equals (a beam tree lists its best beam first), each with up to
``width`` guesses.

When the commit comes and equals a hypothesis, that hypothesis's fork becomes the session: it committed exactly
those tokens from exactly the session's state (in parts, which a session commits to the same state as at once), so
the session is where it would be without drafting ahead, and the tree it drafted is the one the session would draft
now (a sampled draft: a draw from the same law, made with the fork's own copy of the random generator). Any other
commit closes every fork. A tree drafted ahead is only ever a proposal the verifier checks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from stree.protocols.drafter import DraftBudget, ForkableSession
from stree.protocols.token_tree import TokenTree

GUESS_WIDTH = 2
"""Guesses of the target's next token per leaf (the drafter's likeliest tokens there)."""


@dataclass
class Hypothesis:
    """A drafted hypothesis: the tokens it assumes the verifier commits, the fork that committed them, its tree."""

    tokens: tuple[int, ...]
    session: ForkableSession
    tree: TokenTree
    seconds: float


def leaf_paths(tree: TokenTree) -> list[list[int]]:
    """The tokens below the root on the path to each leaf, deepest leaves first (node order among equal depths);
    a root-only tree has one, empty, path (the next token alone is then the hypothesis)."""
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    has_child = [False] * len(tokens)
    for p in parents[1:]:
        has_child[p] = True
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    leaves = sorted((i for i in range(len(tokens)) if not has_child[i]), key=lambda i: (-depth[i], i))
    paths = []
    for leaf in leaves:
        path, node = [], leaf
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        paths.append(path[::-1])
    return paths


def children_of_root(tree: TokenTree) -> list[int]:
    return [t for t, p in zip(tree.tokens.tolist()[1:], tree.parents.tolist()[1:]) if p == 0]


class Lookahead:
    """The hypotheses about one drafted ``tree`` of ``session``, drafted one per ``next`` call, at most ``limit``."""

    def __init__(self, session: ForkableSession, tree: TokenTree, budget: DraftBudget, limit: int,
                 width: int = GUESS_WIDTH):
        self.session = session
        self.budget = budget
        self.limit = int(limit)
        self.width = max(1, min(int(width), self.limit))
        self.paths = leaf_paths(tree)[: math.ceil(self.limit / self.width)]
        self.queued: list[tuple[int, ...]] = []  # hypotheses whose guess is made, not drafted yet
        self.drafted: dict[tuple[int, ...], Hypothesis] = {}
        self.probe: Optional[ForkableSession] = None  # a fork that committed the current path (guesses come from it)
        self.count = 0

    def next(self) -> Optional[Hypothesis]:
        """Draft the next hypothesis (None once ``limit`` are drafted or none is left)."""
        while not self.queued:
            if self.count >= self.limit or not self.paths:
                return None
            self._guess(self.paths.pop(0))
        tokens = self.queued.pop(0)
        t0 = time.perf_counter()
        fork = self.probe.fork()
        try:
            fork.commit([tokens[-1]])
            tree = fork.draft(self.budget)
            if not isinstance(tree, TokenTree):
                raise TypeError(f"draft returned {type(tree).__name__}, not a TokenTree")
        except BaseException:
            fork.close()
            raise
        hypothesis = Hypothesis(tokens, fork, tree, time.perf_counter() - t0)
        self.drafted[tokens] = hypothesis
        self.count += 1
        return hypothesis

    def _guess(self, path: list[int]) -> None:
        """Fork, commit ``path`` (its leaf becomes the root) and queue the leaf's likeliest next tokens."""
        self._drop_probe()
        probe = self.session.fork()
        try:
            if path:
                probe.commit(path)
            one_level = probe.draft(DraftBudget(max_nodes=self.width + 1, max_depth=1, max_width=self.width))
        except BaseException:
            probe.close()
            raise
        self.probe = probe
        room = self.limit - self.count
        self.queued = [tuple(path) + (int(t),) for t in children_of_root(one_level)[: min(self.width, room)]]

    def take(self, tokens: Sequence[int]) -> Optional[Hypothesis]:
        """The drafted hypothesis that commits exactly ``tokens`` (its fork is the caller's now), or None; every
        other fork is closed."""
        hit = self.drafted.pop(tuple(int(t) for t in tokens), None)
        self.close()
        return hit

    def close(self) -> None:
        self._drop_probe()
        for hypothesis in self.drafted.values():
            hypothesis.session.close()
        self.drafted = {}
        self.queued = []
        self.paths = []

    def _drop_probe(self) -> None:
        if self.probe is not None:
            self.probe.close()
            self.probe = None
