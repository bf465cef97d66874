"""One sampling mode's goodput statistics and choice: the shape with the most expected tokens per second.

Per shape (plain decoding included) a running mean of the tokens a step emits per sequence (tau, the bonus
counted) and of what a step costs. A shape is first measured for ``min_samples`` sequence-steps (their plain mean;
a step of B sequences is B samples), then the chooser takes ``argmax tau / cost``. A shape not run for
``retry_every`` steps is retried for as many sequence-steps (a retry's samples outweigh the old mean); a retry that
loses doubles the interval (up to ``max_retry_every``), one that wins resets it. Retries come in bursts: shapes
half-way to their own retry run right after the one that is due, sharing one drafter refresh. A chain's retry runs
the deepest chain, whose steps measure every shorter chain per depth (``DepthAcceptance``). Chains filled by
different sources (a draft model's, prompt lookup's: ``TreeShape.source``) are pooled apart.

With an ``ExploreBudget`` (the engine's) first looks and retries start only while their expected loss fits it, a
shape is first looked at only if it could win at all, and a tree only if it could win at the acceptance of the
chain of its depth. The chooser leaves its current shape only for one ``hysteresis`` faster, and a move from plain
decoding onto a draft is priced with the drafter refresh it pays (one per running sequence, shared by
``refresh_steps`` of the draft's steps). Costs are measured: CUDA-event time per graph replay on the GPU, wall time
on the CPU, or a replay timed when the graph was captured (``prime``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.depth_acceptance import ChainFamilies
from stree.verifier.decode.explore_budget import ExploreBudget


@dataclass
class ShapeStats:
    """What the chooser knows of one shape."""

    shape: TreeShape
    tau: float
    cost: float
    retry_every: int
    seen: int = 0  # steps observed
    last_step: int = -1
    retrying: bool = False
    samples: int = 0  # sequence-steps observed (a step of B running sequences is B samples)
    retry_samples: int = 0  # sequence-steps of the retry under way
    last_clock: float = 0.0  # the budget's clock (measured seconds) at this shape's last sample
    known_cost: bool = False  # ``cost`` came from a timed replay before this shape's first step
    primed: bool = False  # ``tau`` came from an earlier controller's measurement
    pooled: bool = False  # ``tau`` follows the per-depth acceptance of every chain step (chains only)
    measured: bool = False  # its rate rests on numbers (kept up to date by ``remeasure``)

    @property
    def rate(self) -> float:
        """Expected tokens per second per sequence."""
        return self.tau / self.cost if self.cost > 0 else 0.0

    def remeasure(self, min_samples: int) -> None:
        """Its own ``min_samples`` sequence-steps, or a known cost with a primed or pooled tau (plain's tau is
        exact)."""
        self.measured = self.samples >= min_samples or (
            self.known_cost and (self.primed or self.pooled or self.shape.kind == "none"))

    def row(self) -> dict:
        return {"shape": str(self.shape), "tau": self.tau, "cost_ms": 1e3 * self.cost, "tokens_per_s": self.rate,
                "steps": self.seen, "retry_every": self.retry_every, "measured": self.measured,
                "known_cost": self.known_cost, "primed": self.primed, "pooled": self.pooled}


class ShapeChooser:
    """Chooses among ``shapes`` by measured tokens per second; ``alpha`` is the newest sample's weight in the
    running means (acceptance comes in runs: a mean following only the last few steps leaves a good draft in
    each bad run)."""

    def __init__(self, shapes: list[TreeShape], alpha: float = 0.03, retry_every: int = 256,
                 max_retry_every: int = 4096, hysteresis: float = 0.05, refresh_steps: int = 32,
                 min_samples: int = 4, explore_budget: Optional[float] = None, explore_window: Optional[int] = None):
        if not shapes:
            raise ValueError("the goodput controller needs at least one shape")
        self.shapes = list(shapes)
        self.alpha = alpha
        self.retry_every = retry_every
        self.max_retry_every = max(retry_every, max_retry_every)
        # optimistic start: a tree of depth D may emit up to D + 1 tokens; every shape is tried early
        self.stats = {s: ShapeStats(s, tau=float(s.max_depth + 1), cost=1.0, retry_every=retry_every)
                      for s in self.shapes}
        self._rows = list(self.stats.values())  # the per-step loops walk these: no shape hashing in them
        # first looks in this order: of the chains that fit, the deepest (its steps measure every shorter chain)
        self._look_order = sorted(self._rows, key=lambda r: -r.shape.max_depth if r.shape.kind == "chain" else 0)
        self.hysteresis = hysteresis
        self.refresh_steps = refresh_steps
        self.min_samples = max(1, int(min_samples))
        self.budget = ExploreBudget(explore_budget, explore_window)
        self.refresh_s = 0.0  # running mean of the drafter refresh per refreshed sequence
        self.refresh_guess = 0.0  # what refreshing one sequence is taken to cost before one was measured
        self.current: Optional[TreeShape] = None  # the shape chosen on merit (not as a retry) last time
        self.chains = ChainFamilies(self.shapes, self.min_samples)  # acceptance per depth, per source's chains
        self.depths = self.chains.of("")  # the drafter's own chains
        self._any_known_cost = False  # some shape's cost came from a timed replay (``prime``)
        self.burst: list[TreeShape] = []  # retries still to run in this burst, oldest first
        self.step = 0
        self.rows = 1  # sequences in the step being chosen: a burst is as many steps as give min_samples

    def rate(self, shape: TreeShape) -> float:
        """Expected tokens per second per sequence of ``shape``, as measured so far."""
        return self.stats[shape].rate


    def prime(self, shape: TreeShape, tau: Optional[float] = None, cost: Optional[float] = None,
              retry_every: Optional[int] = None) -> None:
        """Start ``shape`` from a known step ``cost`` (seconds, a timed replay) and/or ``tau`` and ``retry_every``
        (another controller's measurement and back-off); ignored once the shape has steps of its own, and tau for
        plain decoding (exactly 1)."""
        r = self.stats.get(shape)
        if r is None or r.samples:
            return
        if cost is not None and cost > 0 and not r.known_cost:
            r.cost, r.known_cost = float(cost), True
            self._any_known_cost = True
        if tau is not None and shape.kind != "none":
            r.tau, r.primed = float(tau), True
        if retry_every is not None:
            r.retry_every = min(max(int(retry_every), self.retry_every), self.max_retry_every)
        r.remeasure(self.min_samples)

    @property
    def refresh_cost(self) -> float:
        """The drafter refresh of one sequence that a step leaving plain decoding pays: the measured mean per
        sequence, else ``refresh_guess``."""
        return self.refresh_s or self.refresh_guess

    def measured(self, shape: TreeShape) -> bool:
        return self.stats[shape].measured

    def _best_row(self, known: Optional[list] = None) -> ShapeStats:
        """The best rate among ``known`` (the measured rows, found here if not given), or every row while none is."""
        if known is None:
            known = [r for r in self._rows if r.measured]
        return max(known or self._rows, key=lambda r: r.rate)

    def burst_steps(self) -> int:
        """Steps of a first look or a retry: enough for ``min_samples`` sequence-steps at ``rows`` sequences a step."""
        return max(1, -(-self.min_samples // self.rows))

    def choose(self, rows: int = 1) -> TreeShape:
        """The shape of the next step, which runs ``rows`` sequences."""
        self.step += 1
        self.rows = max(1, int(rows))
        if self.burst:
            return self._pop_burst()
        known = [r for r in self._rows if r.measured]
        if self.budget.limited and self._any_known_cost:
            if len(known) < len(self._rows):
                first = self._first_look(known)
                if first is not None:
                    return first
        else:
            for r in self._rows:  # measure every shape before trusting the numbers
                if r.samples < self.min_samples:
                    return r.shape
        best = self._best_row(known)
        rate = best.rate
        known = known or self._rows
        if any(self._due_row(r, rate) for r in known):
            half = [r for r in known if r.shape != self.current and self._due_row(r, rate, 0.5)]
            retry: list[TreeShape] = []
            for r in sorted(half, key=lambda r: r.last_step):
                s = self._retried_row(r).shape  # a chain's retry runs the deepest chain
                if s != self.current and s not in retry:
                    retry.append(s)
            self.burst = [s for s in retry for _ in range(self.burst_steps())]
        if self.burst:
            return self._pop_burst()
        # the margin guards only a move onto a draft: leaving one for plain decoding costs nothing
        margin = self.hysteresis if best.shape.kind != "none" else 0.0
        if best.shape.kind != "none":  # a move from plain decoding pays its drafter refresh
            cost = self._move_cost(best)
            rate = best.tau / cost if cost > 0 else 0.0
        if self.current is not None and rate <= (1 + margin) * self.rate(self.current):
            return self.current
        self.current = best.shape
        return best.shape

    def ran_instead(self, shape: TreeShape) -> None:
        """The engine ran ``shape`` instead of the choice on merit (a draining batch): it becomes the current shape,
        so its steps are no exploration charged to the budget."""
        self.current = shape

    def _pop_burst(self) -> TreeShape:
        shape = self.burst.pop(0)
        r = self.stats[shape]
        if not r.retrying and r.measured:  # a first look's steps are plain samples, not a retry
            r.retrying, r.retry_samples = True, 0
        return shape

    def _first_look(self, known: list) -> Optional[TreeShape]:
        """With known costs and a budget: the shape to measure now, if any (``known``: the measured rows).

        Plain decoding and shapes without a known cost are measured first. A first look runs ``burst_steps`` steps
        and starts only if its loss, were no drafted token accepted, fits the budget; ``observe`` then charges what
        its steps actually lost. A tree is looked at only if it could win at the acceptance of the chain of its
        depth, when that is known."""
        unlooked = False
        for r in self._rows:
            if r.measured:
                continue
            if r.shape.kind == "none" or not r.known_cost:
                return r.shape
            unlooked = unlooked or not r.samples
        if not unlooked:  # every shape measured or under way: nothing to look at (the usual case, kept cheap)
            return None
        rate = self._best_row(known).rate
        waiting: set = set()  # sources whose deeper chain that could win waits for the budget: no shorter first
        for r in self._look_order:
            s = r.shape
            if (r.measured or r.samples or (s.max_depth + 1) / r.cost <= rate
                    or (s.kind == "chain" and s.source in waiting)):
                continue  # measured, under way, or it could not win with every drafted token accepted
            chain_tau = self.chains.tau_for(s) if s.kind != "chain" else None
            if chain_tau is not None and not self._could_win(r, rate, chain_tau):
                continue  # the chain of its depth says it would not win
            if self.budget.affords(self._expected_loss(r, 1.0, rate)):  # as if no drafted token were accepted
                self.burst = [s] * (self.burst_steps() - 1)
                return s
            if s.kind == "chain":
                waiting.add(s.source)
        return None

    def _due_row(self, r: ShapeStats, best_rate: float, frac: float = 1.0) -> bool:
        """Whether ``r``'s shape is ``frac`` of the way to its retry: its interval in steps has passed and, with a
        budget, enough measured time that the retry's expected loss against ``best_rate`` fits it."""
        if self.step - r.last_step <= r.retry_every * frac:
            return False
        if not self.budget.limited:
            return True
        run = self._retried_row(r)
        if not self._could_win(run, best_rate):
            return False
        loss = self._expected_loss(run, run.tau, best_rate)
        return self.budget.paced(loss, r.last_clock, frac) and self.budget.affords(loss, frac)

    def _could_win(self, r: ShapeStats, best_rate: float, tau: Optional[float] = None) -> bool:
        """Whether measuring ``r`` again could find a shape worth moving to: it beats ``best_rate`` by the
        hysteresis if its acceptance (``tau``, default its own) rose halfway to its ceiling, the move priced as
        ``choose`` prices it. A retry only re-measures acceptance (costs are timed)."""
        if r.shape.kind == "none":
            return True
        tau = r.tau if tau is None else tau
        tau += 0.5 * max(0.0, r.shape.max_depth + 1 - tau)
        return tau / self._move_cost(r) > (1 + self.hysteresis) * best_rate

    def _move_cost(self, r: ShapeStats) -> float:
        """``r``'s step cost as a move onto its draft pays it: from plain decoding, plus the drafter refresh of every
        running sequence, shared by ``refresh_steps`` of the draft's steps."""
        if self.current is not None and self.current.kind == "none":
            return r.cost + self.refresh_cost * self.rows / self.refresh_steps
        return r.cost

    def _retried_row(self, r: ShapeStats) -> ShapeStats:
        """The row whose shape a retry of ``r`` runs: a chain's retry runs the deepest chain of its source."""
        if r.shape.kind == "chain":
            return self.stats[self.chains.deepest[r.shape.source]]
        return r

    def _expected_loss(self, r: ShapeStats, tau: float, rate: float) -> float:
        """Seconds a burst of ``r``'s shape at ``tau`` loses against ``rate``, plus the refresh of every running
        sequence's drafter when the burst leaves plain decoding."""
        loss = self.burst_steps() * max(0.0, r.cost - (tau / rate if rate > 0 else 0.0))
        if r.shape.kind != "none" and self.current is not None and self.current.kind == "none":
            loss += self.refresh_cost * self.rows
        return loss

    def observe(self, shape: TreeShape, tau: float, seconds: float, refresh_s: float = 0.0,
                emitted: Optional[list[int]] = None, refreshed: int = 1) -> None:
        """One step of ``shape`` emitted ``tau`` tokens per sequence and took ``seconds``, after a drafter refresh
        of ``refreshed`` sequences that took ``refresh_s`` (charged ``1 / refresh_steps`` of it: a switch that wins
        holds for a while). ``emitted``: the tokens each sequence emitted (a chain step's per-depth acceptance)."""
        lost = 0.0
        if self.current is not None and shape != self.current:  # exploring: what it lost against the current shape
            rate = self.rate(self.current)
            lost = max(0.0, seconds + refresh_s - (tau / rate if rate > 0 else 0.0))
        if refresh_s > 0:
            per = refresh_s / max(1, refreshed)
            self.refresh_s = per if self.refresh_s == 0 else self.refresh_s + self.alpha * (per - self.refresh_s)
        seconds += refresh_s / self.refresh_steps
        r = self.stats[shape]
        rows = len(emitted) if emitted else 1
        if r.samples < self.min_samples:  # the plain mean of the first samples
            a = rows / (r.samples + rows)
        elif r.retrying:  # a retry's samples weigh more: what the running mean holds is old (worth one sample)
            r.retry_samples += rows
            a = rows / (r.retry_samples + 1)
        else:
            a = self.alpha
        pooled = bool(emitted) and shape.kind == "chain"
        if pooled:
            self.chains.of(shape.source).observe(shape.max_depth, [n - 1 for n in emitted],
                                                 a if r.retrying else self.alpha)
        r.tau += a * (tau - r.tau)
        r.cost += a * (seconds - r.cost)
        r.seen += 1
        r.samples += rows
        r.remeasure(self.min_samples)
        r.last_step = self.step
        self.budget.tick(seconds, lost)
        r.last_clock = self.budget.clock
        if pooled:
            self._pool_chains(shape)
        if r.retrying and r.retry_samples >= self.min_samples:
            r.retrying = False
            self._back_off(r)

    def _back_off(self, r: ShapeStats) -> None:
        """A retry of ``r``'s shape ended: a winner's interval resets, a loser's doubles (up to the cap). A chain's
        retry measured every shorter chain of its source too, so they share one interval."""
        shape, best = r.shape, self._best_row().shape
        if shape.kind != "chain":
            r.retry_every = self.retry_every if best == shape else min(2 * r.retry_every, self.max_retry_every)
            return
        chains = [c for c in self._rows if c.shape.kind == "chain" and c.shape.source == shape.source
                  and c.shape.max_depth <= shape.max_depth]
        won = best.kind == "chain" and best.source == shape.source and best.max_depth <= shape.max_depth
        every = self.retry_every if won else min(2 * max(c.retry_every for c in chains), self.max_retry_every)
        for c in chains:
            c.retry_every = every

    def _pool_chains(self, stepped: Optional[TreeShape] = None) -> None:
        """Every chain whose depths are measured takes its tau from its source's per-depth rates; those no deeper
        than the ``stepped`` chain of the same source (if any) were measured just now (their retry clock
        restarts)."""
        for r in self._rows:
            s = r.shape
            depths = self.chains.of(s.source) if s.kind == "chain" else None
            if depths is not None and depths.known(s.max_depth):
                r.tau, r.pooled = depths.tau(s.max_depth), True
                r.remeasure(self.min_samples)
                if (stepped is not None and s != stepped and s.source == stepped.source
                        and s.max_depth <= stepped.max_depth):
                    r.last_step, r.last_clock = self.step, self.budget.clock

    def table(self) -> list[dict]:
        """What the chooser believes now, shape by shape."""
        return [r.row() for r in self.stats.values()]
