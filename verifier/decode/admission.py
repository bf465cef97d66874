"""When queued prompts join: the admission hold rule and the measured costs it weighs.

With more prompts waiting than slots free, admitting into each slot as soon as it frees costs one prefill pass per
prompt, while one pass over several prompts costs about as much as a pass over one (BENCHMARKS.md §0j: 6.5 ms for
one prompt against 9.7 ms for four on the demo pair). Speculative rows finish on different steps, so the engine may
keep free slots empty for a few steps while a running sequence is about to finish: each held step idles
``free / batch`` of a step's work, and the hold stops once that adds up to one admission's measured cost (or at
the ``admit_hold_steps`` cap, which bounds the time to first token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass
class AdmissionCosts:
    """Running means of the seconds one admission (its prefill passes) and one step take, as the engine measures
    them (CUDA events per step on the GPU, wall time otherwise); ``alpha`` weighs the newest sample."""

    admit_s: Optional[float] = None
    step_s: Optional[float] = None
    alpha: float = 0.2

    def observe_admit(self, seconds: float) -> None:
        self.admit_s = self._mean(self.admit_s, seconds)

    def observe_step(self, seconds: float) -> None:
        self.step_s = self._mean(self.step_s, seconds)

    def _mean(self, mean: Optional[float], sample: float) -> float:
        return sample if mean is None else mean + self.alpha * (sample - mean)

    def hold_steps(self, free: int, batch: int, cap: int) -> int:
        """Steps ``free`` of ``batch`` slots may stay empty before their idle share of the steps outweighs one
        admission; at most ``cap``; 0 until both costs were measured."""
        if self.admit_s is None or not self.step_s or free < 1:
            return 0
        return min(cap, int(self.admit_s * batch / (self.step_s * free)))  # costs are >= 0, and so is cap


def check_hold_steps(steps) -> int:
    """``admit_hold_steps`` as an int, or ValueError for anything but an integer >= 0."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"admit_hold_steps must be an integer >= 0, got {steps!r}")
    return int(steps)


def steps_to_finish(tokens_left: int, tokens_so_far: int, steps_so_far: int) -> float:
    """Expected steps until a sequence reaches its token limit, at its tokens per step so far (at least 1)."""
    rate = max(1.0, tokens_so_far / steps_so_far) if steps_so_far else 1.0
    return tokens_left / rate


def should_hold(waiting: int, free: int, held: int, budget: int, running: Iterable[float]) -> bool:
    """Keep the free slots empty this step: more prompts wait than fit, the budget (in steps) is not spent, and
    some running sequence should finish within what is left of it (``running``: their ``steps_to_finish``)."""
    left = budget - held
    return left > 0 and waiting > free and any(steps <= left for steps in running)
