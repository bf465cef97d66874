"""How much time goodput control may lose to exploration: a fraction of about the last N steps' measured time.

Every step off the current shape (a first look at a shape, or a retry of one) is charged what it lost against the
current shape; an exploration starts only while the charged total plus its own expected loss stays within
``fraction`` of the clock. With a ``window`` of N steps both sides fade by 1 - 1/N a step, so a budget saved through
a quiet stretch is not spent in one short run.
"""

from __future__ import annotations

from typing import Optional


class ExploreBudget:
    """``fraction`` (None: no budget, every exploration is allowed) of the recent measured seconds."""

    def __init__(self, fraction: Optional[float] = None, window: Optional[int] = None):
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"explore_budget must be in (0, 1], got {fraction}")
        if window is not None and window < 1:
            raise ValueError(f"explore_window must be at least one step, got {window}")
        self.fraction = fraction
        self.fade = 1.0 - 1.0 / window if window else 1.0
        self.clock = 0.0  # measured seconds of every step observed
        self.recent = 0.0  # the same seconds fading by ``fade`` a step: what the budget is a fraction of
        self.spent = 0.0  # seconds lost by steps off the current shape, fading alike

    @property
    def limited(self) -> bool:
        return self.fraction is not None

    def tick(self, seconds: float, lost: float = 0.0) -> None:
        """One step took ``seconds`` and (exploring) lost ``lost`` of them against the current shape."""
        self.spent = self.spent * self.fade + lost
        self.clock += seconds
        self.recent = self.recent * self.fade + seconds

    def affords(self, loss: float, frac: float = 1.0) -> bool:
        """Whether ``frac`` of an exploration expected to lose ``loss`` seconds fits the budget now."""
        return not self.limited or self.spent + frac * loss <= self.fraction * self.recent

    def paced(self, loss: float, since: float, frac: float = 1.0) -> bool:
        """Whether enough measured time passed ``since`` (a clock reading) for ``frac`` of ``loss`` to be within
        the fraction of it (a retry's pacing)."""
        return not self.limited or self.clock - since >= frac * loss / self.fraction
