"""Timing generations against each other on this machine: a warm-up each, runs interleaved, medians, a noise check.

One timed run per method can say 13x on one run and 0.2x on the next on a loaded machine. So every method runs
``runs`` times, round-robin (a slow stretch of the machine falls on every method alike), and its median counts. The
spread of a method's runs, (max - min) / median, says how far a ratio between medians can be trusted: above
``NOISE_LIMIT`` the machine is too noisy to compare methods.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

NOISE_LIMIT = 0.15  # a method whose runs spread more than this (relative to their median) makes ratios unreliable
WARM_UP_TOKENS = 8


@dataclass
class TimedRuns:
    """One method's timed runs: the first run's result and every run's tokens/s."""

    result: object
    tokens_per_s: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def spread(self) -> float:
        """(max - min) / median of the runs' tokens/s; 0 for one run."""
        med = self.median
        return (max(self.tokens_per_s) - min(self.tokens_per_s)) / med if med > 0 else 0.0


def time_interleaved(calls: dict[str, Callable[[int], object]], runs: int, max_new_tokens: int) -> dict[str, TimedRuns]:
    """Time each ``calls[name](max_new_tokens)`` (a generation returning a result with ``token_ids``) ``runs``
    times, round-robin, after one short warm-up call each (kernel selection, graph capture, caches)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    for call in calls.values():
        call(WARM_UP_TOKENS)
    timed: dict[str, TimedRuns] = {}
    for _ in range(runs):
        for name, call in calls.items():
            t0 = time.perf_counter()
            res = call(max_new_tokens)
            elapsed = time.perf_counter() - t0
            entry = timed.setdefault(name, TimedRuns(result=res))
            entry.tokens_per_s.append(len(res.token_ids) / elapsed if elapsed > 0 else 0.0)
    return timed


def noisy(timed: dict[str, TimedRuns], limit: float = NOISE_LIMIT) -> list[str]:
    """The methods whose runs spread more than ``limit``: when any does, the machine is too noisy to compare."""
    return [name for name, t in timed.items() if len(t.tokens_per_s) > 1 and t.spread > limit]


def noise_warning(names: list[str], timed: dict[str, TimedRuns], limit: float = NOISE_LIMIT) -> str:
    spreads = ", ".join(f"{n} {100 * timed[n].spread:.0f} %" for n in names)
    return (f"this machine is too noisy to compare speeds: the runs of {spreads} spread more than {100 * limit:.0f} % "
            "of their median (other work on the machine?); the ratios above are not reliable")
