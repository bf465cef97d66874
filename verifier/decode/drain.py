"""A draining batch finishes with its slowest sequence: draft only while that helps the sequence that ends last.

Goodput control compares tokens per second per sequence (tau / cost), which is what matters while new requests
wait to take freed slots. When nothing waits, the running set is done when its last sequence is, and drafts
help sequences unevenly: plain decoding finishes equal-length sequences together, a draft finishes the
well-predicted ones early and leaves the poorly predicted ones to run on with a costlier step, so a draft ahead
by tau / cost can still finish the batch later than plain decoding. So when the batch drains, the engine compares the
time to finish the whole running set both ways, with each sequence's own acceptance.

Each sequence's own rate is shrunk towards the batch's (times what the slowest of a batch this size accepted in
earlier batches: ``SlowestPrior``) as far as the spread of the sequences' rates is what per-step noise would give
(empirical Bayes): with a few draft steps each, the lowest of 16 noisy rates is low by chance, and trusting it
would turn a batch that drafting finishes sooner to plain steps for good (no draft step then teaches otherwise). A
sequence that really accepts less spreads the rates beyond the noise and is trusted within a step or two.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

PRIOR_STEPS = 4.0  # draft steps' worth of the prior in each sequence's acceptance estimate


class SlowestPrior:
    """How a sequence's acceptance compares with the traffic's, from sequences that finished (the last ``keep``).

    A new sequence has no draft steps of its own, yet in a batch of B one of them will be about the slowest of B.
    Its prior is that: the 1 / (B + 1) quantile of the recorded ratios (with the batch mean alone a fresh batch looks
    uniform, and it drafts before its slow sequences show). Ratios are
    taken against a running mean over recent draft steps, not against the sequences still running: the slowest
    sequence finishes last, when no other is left to compare it with."""

    def __init__(self, keep: int = 512, min_history: int = 32, decay: float = 0.99):
        self.ratios: collections.deque[float] = collections.deque(maxlen=keep)
        self.min_history = min_history
        self.decay = decay
        self._accepted = 0.0  # decayed sums over recent draft steps: accepted drafted tokens, their squares,
        self._squares = 0.0  # and sequence-steps
        self._steps = 0.0
        self._ordered: list[float] | None = None  # ``ratios`` sorted, kept until a ratio is added (read every step)

    def observe(self, accepted: Sequence[int]) -> None:
        """One draft step: the drafted tokens each of its sequences accepted."""
        self._accepted = self.decay * self._accepted + sum(accepted)
        self._squares = self.decay * self._squares + sum(a * a for a in accepted)
        self._steps = self.decay * self._steps + len(accepted)

    @property
    def mean(self) -> float:
        """Accepted drafted tokens per sequence-step, over recent draft steps."""
        return self._accepted / self._steps if self._steps else 0.0

    @property
    def variance(self) -> Optional[float]:
        """Variance of one sequence-step's accepted drafted tokens over recent draft steps (None before any): the
        per-step noise, with the sequences' real differences in it too, so it errs towards shrinking."""
        if not self._steps:
            return None
        return max(0.0, self._squares / self._steps - self.mean ** 2)

    def record(self, accepted: int, draft_steps: int, prior_steps: float = PRIOR_STEPS) -> None:
        """A finished sequence's accepted tokens per draft step, shrunk towards the running mean, over that mean."""
        mean = self.mean
        if draft_steps <= 0 or mean <= 0:
            return
        self.ratios.append((accepted + prior_steps * mean) / (draft_steps + prior_steps) / mean)
        self._ordered = None

    def extend(self, other: "SlowestPrior") -> None:
        """Add ``other``'s ratios (another engine's, over the same drafter and traffic)."""
        self.ratios.extend(other.ratios)
        self._ordered = None

    def ratio(self, batch: int) -> float:
        """The prior ratio for a batch of ``batch`` sequences; 1 (the batch mean) until enough have finished."""
        if len(self.ratios) < self.min_history or batch <= 1:
            return 1.0
        if self._ordered is None:
            self._ordered = sorted(self.ratios)
        return self._ordered[min(len(self._ordered) - 1, int(len(self._ordered) / (batch + 1)))]


def sequence_taus(tau: float, accepted: Sequence[int], draft_steps: Sequence[int], prior_ratio: float = 1.0,
                  prior_steps: float = PRIOR_STEPS, step_variance: Optional[float] = None) -> list[float]:
    """Each sequence's expected tokens per step of a draft whose batch-wide tau is ``tau``.

    ``accepted[i]``: drafted tokens sequence i accepted so far over ``draft_steps[i]`` draft steps. Its accepted
    tokens per step relative to the batch's scales the draft's ``tau - 1``: a sequence that accepts half the batch
    mean gets half the draft's gain. The own rate is shrunk towards ``prior_ratio`` times the batch's: with
    ``step_variance`` (one sequence-step's variance) by the empirical-Bayes weight ``between / (between + noise)``,
    ``between`` the spread of the rates beyond what that noise explains; without it, by ``prior_steps`` steps.
    """
    total_steps = sum(draft_steps)
    if total_steps == 0:  # nothing of their own yet: each sequence is the prior
        return [1.0 + (tau - 1.0) * prior_ratio] * len(accepted)
    mean = sum(accepted) / total_steps
    if mean <= 0:
        return [1.0] * len(accepted)
    target = prior_ratio * mean
    between = _between_variance(accepted, draft_steps, mean, step_variance)
    out = []
    for a, n in zip(accepted, draft_steps):
        if between is None:
            own = (a + prior_steps * target) / (n + prior_steps)
        elif n == 0:
            own = target
        else:
            noise = step_variance / n
            weight = between / (between + noise) if between + noise > 0 else 1.0
            own = weight * a / n + (1.0 - weight) * target
        out.append(1.0 + (tau - 1.0) * own / mean)
    return out


def _between_variance(accepted: Sequence[int], draft_steps: Sequence[int], mean: float,
                      step_variance: Optional[float]) -> Optional[float]:
    """How much the sequences' own rates spread beyond per-step noise (at least 0); None without a noise figure
    or with fewer than two sequences that drafted."""
    rates = [(a / n, n) for a, n in zip(accepted, draft_steps) if n > 0]
    if step_variance is None or len(rates) < 2:
        return None
    spread = sum((r - mean) ** 2 for r, _ in rates) / (len(rates) - 1)
    noise = step_variance * sum(1.0 / n for _, n in rates) / len(rates)
    return max(0.0, spread - noise)


def draft_finishes_later(remaining: Sequence[int], taus: Sequence[float], draft_cost: float,
                         plain_cost: float) -> bool:
    """Whether drafting every step from now on would finish the running set later than plain decoding.

    ``remaining[i]``: tokens sequence i may still emit; ``taus[i]``: its expected tokens per draft step; costs in
    seconds per step. Plain decoding ends after ``max(remaining)`` steps, drafting after ``max(remaining / tau)``.
    """
    if not remaining:
        return False
    plain = max(remaining) * plain_cost
    draft = max(r / max(t, 1.0) for r, t in zip(remaining, taus)) * draft_cost
    return draft > plain
