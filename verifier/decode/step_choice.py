"""The shape of each engine step: fixed, forced (warm-up), or chosen by goodput control.

Under goodput control (``goodput.py``) the chooser also keeps the priors a new controller starts from, the
draining rule (``drain.py``: with nothing waiting, plain steps when they finish the running set sooner) and what
each collected step taught it (acceptance, cost, how slow a batch's slowest sequence is).
"""

from __future__ import annotations

from typing import Optional

from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.drain import SlowestPrior, draft_finishes_later, sequence_taus
from stree.verifier.decode.goodput import GoodputController, GoodputPriors
from stree.verifier.decode.request import Request
from stree.verifier.decode.step_graphs import StepKey

PLAIN = TreeShape.parse("none")


class StepChooser:
    """Chooses among ``shapes``: the last one for host drafters, the first without goodput control."""

    def __init__(self, shapes: list[TreeShape], host: bool, goodput: bool, deferred: bool, admit_cost):
        self.shapes, self.host, self.deferred = shapes, host, deferred
        self.admit_cost = admit_cost  # () -> an admission's measured seconds, or None
        self.priors = GoodputPriors()
        self.slow_prior = SlowestPrior()  # how slow the slowest sequence of a batch tends to be
        self.forced: Optional[list] = None  # warm-up cycles through these instead of choosing
        self.goodput: Optional[GoodputController] = self.controller() if goodput else None

    def controller(self) -> GoodputController:
        """A fresh controller from the priors. A drafter refresh costs nothing where the drafter follows every
        step; where it is deferred, the timed refresh, else an admission (an overestimate), until one is measured."""
        ctl = self.priors.controller(self.shapes)
        self.guess_refresh(ctl)
        return ctl

    def guess_refresh(self, ctl: Optional[GoodputController] = None) -> None:
        ctl = ctl or self.goodput
        if ctl is None:
            return
        if not self.deferred:
            ctl.guess_refresh(0.0)
            return
        guess = self.priors.refresh_s if self.priors.refresh_s is not None else self.admit_cost()
        if guess is not None:
            ctl.guess_refresh(guess)

    def captured(self, key: StepKey, seconds: float) -> None:
        """A step graph was captured and its replay timed: that is the shape's cost until it runs."""
        shape = key.timed_shape
        if shape is not None:
            self.priors.add_cost(shape, key.sampled, seconds)
            if self.goodput is not None:
                self.goodput.prime(shape, key.sampled, cost=seconds)

    def inherit(self, other: "StepChooser") -> None:
        """Start from what ``other`` (over the same drafter) learned of acceptance and refreshes."""
        if self.goodput is None or other.goodput is None:
            return
        self.priors.take_over(other.priors)
        self.priors.remember(other.goodput)
        self.slow_prior.extend(other.slow_prior)
        self.priors.prime(self.goodput)
        self.guess_refresh()

    def choose(self, sampled: bool, running: list[Request], waiting: int) -> tuple[TreeShape, bool]:
        """The next step's shape, and whether the draining rule replaced a draft by a plain step."""
        if self.forced is not None:
            self.forced.append(self.forced.pop(0))
            return self.forced[-1], False
        if self.host:
            return self.shapes[-1], False
        if self.goodput is None:
            return self.shapes[0], False
        shape = self.goodput.choose(sampled, len(running))
        if shape.kind != "none" and not waiting and len(running) > 1 and self._drain_prefers_plain(
                shape, sampled, running):
            self.goodput.mode(sampled).ran_instead(PLAIN)
            return PLAIN, True
        return shape, False

    def _drain_prefers_plain(self, shape: TreeShape, sampled: bool, running: list[Request]) -> bool:
        """Whether plain decoding finishes ``running`` sooner than the draft ``shape`` chosen on merit (retries and
        first looks run as chosen)."""
        mode = self.goodput.mode(sampled)
        if shape != mode.current or PLAIN not in mode.stats:
            return False
        running = [r for r in running if not r.done]
        taus = sequence_taus(mode.stats[shape].tau, [r.num_accepted_draft_tokens for r in running],
                             [r.draft_steps for r in running], self.slow_prior.ratio(len(running)),
                             step_variance=self.slow_prior.variance)
        remaining = [r.max_new_tokens - len(r.output) for r in running]
        return draft_finishes_later(remaining, taus, mode.stats[shape].cost, mode.stats[PLAIN].cost)

    def observe(self, shape: TreeShape, sampled: bool, seconds: float, accepted: list[int], drafted: int,
                measured: bool, refresh_s: float, refreshed: int) -> None:
        """A collected step of ``shape``: each running sequence emitted ``accepted[j]`` tokens."""
        if self.goodput is None or not accepted:
            return
        if drafted:
            self.slow_prior.observe([a - 1 for a in accepted])
        if measured:
            self.goodput.observe(shape, sum(accepted) / len(accepted), seconds, refresh_s, refreshed=refreshed,
                                 sampled=sampled, emitted=accepted)

    def released(self, req: Request) -> None:
        """A sequence left: its acceptance tells how slow a batch's slowest sequence tends to be."""
        if req.draft_steps and self.goodput is not None:
            self.slow_prior.record(req.num_accepted_draft_tokens, req.draft_steps)
