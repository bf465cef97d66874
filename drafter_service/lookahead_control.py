"""When drafting ahead pays: a rule on what one session measured (``lookahead.py`` drafts, this decides).

Drafting ahead costs nothing while the drafter would be idle anyway: between sending a tree and hearing the
verifier's commit (the verifier's *window*: its verify step and the round trip). What it can cost is the time a
hypothesis still runs when the commit arrives and the commit was not one of the hypotheses (a *miss*): the drafter
must finish it before drafting the tree the verifier waits for. What a *hit* saves is a whole commit-and-draft. So
hypothesis ``rank`` (0 the likeliest) is drafted ``elapsed`` seconds after the tree went out when it should be done
within the window, or else when its expected saving outweighs its expected delay:

    p(rank) * draft_s  >  (1 - p(rank)) * (elapsed + cost(rank) - window)

with ``p(rank)`` the measured rate at which that rank came true (Laplace's rule: (hits + 1) / (tries + 2)),
``draft_s`` the measured commit-and-draft time, ``cost(rank)`` the measured time to draft that hypothesis (a rank not
drafted yet: the nearest one below it, else ``draft_s``), and ``window`` the measured window; each a running mean.
Before a window and a draft are measured only the likeliest hypothesis is tried.
"""

from __future__ import annotations

from typing import Optional

SMOOTHING = 0.2
"""Weight of the newest sample in each running mean."""


class RunningMean:
    def __init__(self):
        self.value: Optional[float] = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * x


class LookaheadControl:
    """The measurements of one session and the rule above."""

    def __init__(self):
        self.window = RunningMean()
        self.draft_s = RunningMean()
        self.cost: dict[int, RunningMean] = {}
        self.tries: dict[int, int] = {}
        self.hits: dict[int, int] = {}

    def p_hit(self, rank: int) -> float:
        return (self.hits.get(rank, 0) + 1) / (self.tries.get(rank, 0) + 2)

    def worth(self, rank: int, elapsed: float) -> bool:
        """Whether to draft hypothesis ``rank`` now, ``elapsed`` seconds after the tree went out."""
        if self.window.value is None or self.draft_s.value is None:
            return rank == 0  # nothing measured yet: try the likeliest one
        known = [r for r in self.cost if r <= rank]  # a rank not drafted yet costs what the nearest one below did
        cost = self.cost[max(known)].value if known else self.draft_s.value
        overrun = elapsed + cost - self.window.value
        if overrun <= 0:
            return True
        p = self.p_hit(rank)
        return p * self.draft_s.value > (1 - p) * overrun

    def drafted(self, rank: int, seconds: float) -> None:
        """Hypothesis ``rank`` took ``seconds`` (wall, as the service waited for it)."""
        self.cost.setdefault(rank, RunningMean()).add(seconds)

    def observed(self, window_s: float, tried: int, hit_rank: Optional[int]) -> None:
        """The commit came ``window_s`` after the tree went out; ``tried`` hypotheses were drafted, ``hit_rank`` the
        one it matched (None: a miss)."""
        self.window.add(window_s)
        for rank in range(tried):
            self.tries[rank] = self.tries.get(rank, 0) + 1
        if hit_rank is not None:
            self.hits[hit_rank] = self.hits.get(hit_rank, 0) + 1

    def drafted_fresh(self, seconds: float) -> None:
        """A commit-and-draft the verifier waited for took ``seconds`` (what a hit would have saved)."""
        self.draft_s.add(seconds)
