"""Goodput control (SmartSpec's idea): each step, the tree shape with the most expected tokens per second.

``GoodputController`` keeps one ``ShapeChooser`` (``shape_chooser.py``: statistics, first looks, retries, the
exploration budget) per sampling mode: greedy steps and steps with a sampled row accept very differently, and a
controller that carried one mode's numbers into the other would relearn each time the traffic changed.
``GoodputPriors`` is what a controller starts from: each step graph's replay time measured when it was captured, and
the acceptance, retry back-off, per-depth chain acceptance and drafter-refresh cost learned by earlier controllers
over the same drafter (acceptance belongs to the drafter and the traffic, not to the batch size).
BENCHMARKS.md holds the measurements behind the rules and constants.
"""

from __future__ import annotations

import copy
from typing import Optional

from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.shape_chooser import ShapeChooser

EXPLORE_BUDGET = 0.02
"""First looks and retries together may lose at most this fraction of the recent time against the best shape."""
EXPLORE_WINDOW = 1024
"""Steps over which that fraction is counted (older steps fade)."""


class GoodputController:
    """A ``ShapeChooser`` per sampling mode (``sampled``: the step has a row with temperature > 0), made when that
    mode first runs. ``knobs`` go to every chooser; the sampled mode's running means weigh the newest sample
    ``sampled_alpha`` (sampled acceptance varies from step to step by the draws more than it comes in runs)."""

    def __init__(self, shapes: list[TreeShape], sampled_alpha: float = 0.1, **knobs):
        self.shapes = list(shapes)
        self._knobs = knobs
        self._sampled_alpha = sampled_alpha
        self.refresh_guess = 0.0  # ``guess_refresh``'s value, for modes made later
        self.modes = {False: ShapeChooser(self.shapes, **knobs)}

    def mode(self, sampled: bool = False) -> ShapeChooser:
        if sampled not in self.modes:
            knobs = {**self._knobs, "alpha": self._sampled_alpha} if sampled else self._knobs
            self.modes[sampled] = ShapeChooser(self.shapes, **knobs)
            self.modes[sampled].refresh_guess = self.refresh_guess
        return self.modes[sampled]

    @property
    def stats(self) -> dict:
        """The greedy mode's running statistics per shape."""
        return self.modes[False].stats

    @property
    def current(self) -> Optional[TreeShape]:
        """The greedy mode's shape chosen on merit last."""
        return self.modes[False].current

    def choose(self, sampled: bool = False, rows: int = 1) -> TreeShape:
        """The next step's shape in the ``sampled`` mode, for a step of ``rows`` running sequences."""
        return self.mode(sampled).choose(rows)

    def prime(self, shape: TreeShape, sampled: bool, tau: Optional[float] = None, cost: Optional[float] = None,
              retry_every: Optional[int] = None) -> None:
        """``ShapeChooser.prime`` in the ``sampled`` mode's statistics."""
        self.mode(sampled).prime(shape, tau=tau, cost=cost, retry_every=retry_every)

    def guess_refresh(self, seconds: float) -> None:
        """Take refreshing one sequence's drafter to cost ``seconds`` in every mode (and modes made later) until a
        refresh is measured."""
        self.refresh_guess = float(seconds)
        for chooser in self.modes.values():
            chooser.refresh_guess = self.refresh_guess

    def observe(self, shape: TreeShape, tau: float, seconds: float, refresh_s: float = 0.0,
                sampled: bool = False, emitted: Optional[list[int]] = None, refreshed: int = 1) -> None:
        self.mode(sampled).observe(shape, tau, seconds, refresh_s, emitted, refreshed)

    def learned(self) -> dict:
        """``{(sampled, shape): (tau, retry_every)}`` of every drafted shape with numbers behind it (its own steps or
        a prime): a draft that kept losing its retries is retried as rarely by the next controller."""
        return {(sampled, s): (r.tau, r.retry_every) for sampled, chooser in self.modes.items()
                for s, r in chooser.stats.items()
                if s.kind != "none" and (r.samples >= chooser.min_samples or r.primed or r.pooled)}

    def learned_depths(self) -> dict:
        """``{sampled: {source: DepthAcceptance}}`` (copies) of every mode and chain source that measured some
        depth."""
        learned = {sampled: {source: copy.deepcopy(d) for source, d in chooser.chains.by_source.items() if d.rate}
                   for sampled, chooser in self.modes.items()}
        return {sampled: by_source for sampled, by_source in learned.items() if by_source}

    def prime_depths(self, depths: dict) -> None:
        """Start each mode's per-depth chain acceptance from ``depths`` (``learned_depths`` of another controller)."""
        for sampled, by_source in depths.items():
            chooser = self.mode(sampled)
            for source, rates in by_source.items():
                chooser.chains.of(source).copy_from(rates)
            chooser._pool_chains()

    def table(self) -> list[dict]:
        """What the controller believes now, per sampling mode that has run and shape."""
        return [{**row, "sampled": sampled} for sampled, chooser in sorted(self.modes.items())
                for row in chooser.table()]


class GoodputPriors:
    """What a new controller over one drafter starts from (see the module docstring)."""

    def __init__(self):
        self.costs: dict = {}  # (shape, sampled) -> seconds per replay of its step graph
        self.tau: dict = {}  # (sampled, shape) -> (tau, retry_every)
        self.depths: dict = {}  # sampled -> {source: DepthAcceptance} of chain drafts
        self.refresh_s: Optional[float] = None  # one drafter refresh, timed (else admissions stand in)

    def add_cost(self, shape: TreeShape, sampled: bool, seconds: float) -> None:
        self.costs[(shape, sampled)] = seconds

    def remember(self, ctl: GoodputController) -> None:
        """Keep what ``ctl`` learned, for controllers made later."""
        self.tau.update(ctl.learned())
        self.depths.update(ctl.learned_depths())

    def take_over(self, other: "GoodputPriors") -> None:
        """Learn what ``other`` (an engine's over the same drafter) knows of acceptance and refreshes; step costs are
        each engine's own (they depend on its batch size)."""
        self.tau.update(other.tau)
        self.depths.update(other.depths)
        if self.refresh_s is None:
            self.refresh_s = other.refresh_s

    def prime(self, ctl: GoodputController) -> None:
        """Start ``ctl`` from these priors (costs, tau and back-off, per-depth acceptance)."""
        for (sampled, shape), (tau, retry_every) in self.tau.items():
            ctl.prime(shape, sampled, tau=tau, retry_every=retry_every)
        ctl.prime_depths(self.depths)
        for (shape, sampled), seconds in self.costs.items():
            ctl.prime(shape, sampled, cost=seconds)

    def controller(self, shapes: list[TreeShape]) -> GoodputController:
        """A fresh controller over ``shapes`` with the engine's exploration budget, started from these priors."""
        ctl = GoodputController(shapes, explore_budget=EXPLORE_BUDGET, explore_window=EXPLORE_WINDOW)
        self.prime(ctl)
        return ctl
