"""The ``oracle`` drafter: knows the target's greedy continuation and is right for exactly ``k`` levels.

For benchmarks at real scale with random weights, where no trained drafter exists: each step's tree
holds the next ``k`` tokens of the known continuation as a chain, a wrong token below them, and
random wrong siblings filling the tree to ``nodes`` nodes. Greedy verification then accepts exactly
``k`` tokens plus the bonus token, so the mean accepted length is ``tau = k + 1`` while the verifier
pays for a tree of the given size.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional, Sequence

from stree.protocols.drafter import ContextSession, DraftBudget, HostDrafter
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree


class OracleDrafter(HostDrafter):
    """``continuation``: the target's greedy tokens after ``prompt``; ``correct_depth``: k; ``nodes``: tree size."""

    name = "oracle"

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], vocab_size: int,
                 correct_depth: int, nodes: int = 0, seed: int = 0,
                 refresh: Optional[Callable[[list], list]] = None):
        if correct_depth < 0:
            raise ValueError(f"oracle drafter: correct_depth must be >= 0, got {correct_depth}")
        if vocab_size < 2:
            raise ValueError(f"oracle drafter: vocab_size must be >= 2, got {vocab_size}")
        if nodes and nodes < correct_depth + 2:
            raise ValueError(f"oracle drafter: {nodes} nodes cannot hold a chain of {correct_depth} "
                             f"right tokens, its root and a wrong token ({correct_depth + 2} nodes)")
        self.prompt = [int(t) for t in prompt]
        self.continuation = [int(t) for t in continuation]
        self.vocab_size = int(vocab_size)
        self.k = int(correct_depth)
        self.nodes = int(nodes) or self.k + 2
        self.seed = seed
        self.refresh = refresh  # context -> the target's greedy continuation after it
        self.refresh_s = 0.0  # time spent in refresh, over all sessions
        self.refreshes = 0

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "OracleSession":
        if [int(t) for t in prompt_ids] != self.prompt:
            raise ValueError("oracle drafter: opened on a prompt other than the one its continuation follows")
        return OracleSession(self, prompt_ids, params)


class OracleSession(ContextSession):
    def __init__(self, drafter: OracleDrafter, prompt_ids: Sequence[int], params: SamplingParams):
        super().__init__(prompt_ids, params)
        self.d = drafter
        self.rng = random.Random(drafter.seed)
        self.base = len(self.context)  # the continuation follows the first ``base`` context tokens
        self.continuation = list(drafter.continuation)
        self.diverged = False  # the accepted tokens left the known continuation (then it drafts nothing)

    def commit(self, tokens: Sequence[int]) -> None:
        start = len(self.context) - self.base
        ok = [int(t) for t in tokens] == self.continuation[start: start + len(tokens)]
        super().commit(tokens)
        if not ok:
            self._refresh()

    def _refresh(self) -> None:
        if self.d.refresh is None:
            self.diverged = True
            return
        t0 = time.perf_counter()
        self.continuation = [int(t) for t in self.d.refresh(list(self.context))]
        self.base = len(self.context)
        self.d.refresh_s += time.perf_counter() - t0
        self.d.refreshes += 1

    def _wrong(self, right: int) -> int:
        tok = self.rng.randrange(self.d.vocab_size - 1)
        return tok + 1 if tok >= right else tok  # uniform over every token but ``right``

    def draft(self, budget: DraftBudget) -> TokenTree:
        pos = len(self.context) - self.base
        if pos >= len(self.continuation) - 1 and self.d.refresh is not None and not self.diverged:
            self._refresh()
            pos = 0
        future = self.continuation[pos:]
        if self.diverged or not future:
            return self.root_only()
        nodes = min(self.d.nodes, budget.max_nodes)
        k = min(self.d.k, len(future) - 1, budget.max_depth - 1, nodes - 2)
        if k < 0:
            return self.root_only()
        tokens, parents = [self.context[-1]], [-1]
        for d in range(k):  # the right chain: nodes 1..k
            tokens.append(future[d])
            parents.append(d)
        tokens.append(self._wrong(future[k]))  # a wrong token below it stops acceptance at depth k
        parents.append(k)
        depths = list(range(k + 2))  # the right chain is nodes 0..k (node d at depth d), then the wrong node
        children = [1] * (k + 1) + [0]
        tries = 0
        while len(tokens) < nodes and tries < 64 * nodes:  # wrong siblings anywhere, within the budget
            tries += 1
            parent = self.rng.randrange(len(tokens))
            if children[parent] >= budget.max_width or depths[parent] >= budget.max_depth:
                continue
            # below a chain node d anything but its right child future[d]; below a wrong node, any token
            tokens.append(self._wrong(future[parent]) if parent <= k else self.rng.randrange(self.d.vocab_size))
            parents.append(parent)
            depths.append(depths[parent] + 1)
            children[parent] += 1
            children.append(0)
        return TokenTree(tokens, parents)
