"""Running per-depth acceptance of chain drafts, from which the tau of every chain length follows.

A chain:K step whose sequence accepted ``a`` drafted tokens tried depths 1..min(a + 1, K) and passed
depths 1..a. The draft at depth d does not depend on K (greedy: the same tokens; sampled: the same
law), so ``p[d]`` (acceptance at depth d, given depth d - 1 was accepted) pools the steps of every
chain length, and chain:K's expected tokens per step is ``1 + sum_k prod_{d<=k} p[d]``. Goodput
control (SmartSpec) uses this so one chain's steps measure every shorter chain.
"""

from __future__ import annotations

from typing import Optional, Sequence

from stree.protocols.tree_shape import TreeShape


class DepthAcceptance:
    """``p[d]`` per depth as a running mean: the plain mean of a depth's first ``min_samples`` samples (a
    sequence that tried the depth in a step is one), then an exponential one whose weight per step the caller
    gives (``observe``)."""

    def __init__(self, min_samples: int = 4):
        self.min_samples = max(1, int(min_samples))
        self.rate: list[float] = []  # rate[d - 1]: acceptance at depth d given depth d - 1 was accepted
        self.samples: list[int] = []  # sequence-steps that tried depth d

    def observe(self, depth: int, accepted: Sequence[int], weight: float) -> None:
        """One chain step of ``depth`` drafted tokens; ``accepted``: drafted tokens each sequence accepted;
        ``weight``: the newest sample's weight once a depth has its first ``min_samples`` samples."""
        for d in range(1, depth + 1):
            tried = sum(1 for a in accepted if a >= d - 1)
            if not tried:
                return
            passed = sum(1 for a in accepted if a >= d)
            if d > len(self.rate):
                self.rate.append(0.0)
                self.samples.append(0)
            n = self.samples[d - 1]
            w = tried / (n + tried) if n < self.min_samples else weight
            self.rate[d - 1] += w * (passed / tried - self.rate[d - 1])
            self.samples[d - 1] = n + tried

    def known(self, depth: int) -> bool:
        """Whether depths 1..``depth`` each have ``min_samples`` samples behind their rate."""
        return depth <= len(self.samples) and all(n >= self.min_samples for n in self.samples[:depth])

    def tau(self, depth: int) -> float:
        """Expected tokens per step of chain:``depth`` (the bonus token counted)."""
        if depth > len(self.rate):
            raise ValueError(f"no acceptance measured at depth {len(self.rate) + 1} (asked for chain:{depth})")
        tau, run = 1.0, 1.0
        for p in self.rate[:depth]:
            run *= p
            tau += run
        return tau

    def copy_from(self, other: "DepthAcceptance") -> None:
        """Start from ``other``'s rates (another engine's, over the same drafter), where this one has none."""
        if not self.rate:
            self.rate, self.samples = list(other.rate), list(other.samples)


class ChainFamilies:
    """Chains pool by depth only with chains of the same source (a draft model's, prompt lookup's:
    ``TreeShape.source``): per source, the ``DepthAcceptance`` of its chains and its deepest chain among ``shapes``."""

    def __init__(self, shapes: Sequence[TreeShape], min_samples: int):
        self.min_samples = min_samples
        self.by_source: dict[str, DepthAcceptance] = {}
        self.deepest: dict[str, TreeShape] = {}
        for s in shapes:
            if s.kind == "chain" and s.max_depth > getattr(self.deepest.get(s.source), "max_depth", 0):
                self.deepest[s.source] = s

    def of(self, source: str) -> DepthAcceptance:
        """``source``'s per-depth acceptance (made on first use)."""
        if source not in self.by_source:
            self.by_source[source] = DepthAcceptance(self.min_samples)
        return self.by_source[source]

    def tau_for(self, shape: TreeShape) -> Optional[float]:
        """The tau of the chain as deep as ``shape`` from the same source, when its depths are measured (a fused
        shape has no one source)."""
        if shape.kind == "fused":
            return None
        depths = self.of(shape.source)
        return depths.tau(shape.max_depth) if depths.known(shape.max_depth) else None
