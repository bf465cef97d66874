"""Goodput control (SmartSpec's idea): each step, the tree shape with the most expected tokens per second.

For every candidate shape (plain decoding included) the controller keeps a running mean of the
tokens a step emits per sequence (tau, the bonus counted) and of what a step costs. Each shape is
first measured for ``min_samples`` sequence-steps (their plain mean; a step of B running sequences is
B of them, so at batch >= 4 one step will do): one sequence's tau in one step is too noisy to decide on
(measured on the H100: a single exploring step put chain:4 at tau 1.5 where it averages 2.9, so auto
kept plain decoding where chain:4 was 1.10-1.15x faster). Then it picks ``argmax tau / cost``; a
shape not tried for a while is retried for as many steps (their mean then outweighs the old
estimate 4 to 1), so a change in acceptance (a new prompt, a new domain) is noticed. A retry that
loses again doubles that shape's retry interval (up to ``max_retry_every``), so a drafter that never
pays costs ever less; one that wins resets it. Retries
come in bursts: when one shape is due, every shape at least half-way to its own retry is retried in
the steps right after it, since they share one refresh of the engine's stale drafter slots. With an
``explore_budget`` (the engine uses 2 %) a retry also waits until the time it is expected to lose
against the best shape (with the drafter refresh it pays in full when it leaves plain decoding, one per running
sequence: at batch 4 on the H100 the refreshes, not the retried steps, made the exploring runs ~10 % slower than
plain) is at
most that fraction of the measured time since the shape last ran: the
steps-only rule spent 10-20 % of short runs re-measuring drafts that lose by far (measured on the
H100 at batch 4, where auto ran at 0.82x plain while plain was its choice). The
controller leaves its current shape only for one at least ``hysteresis`` faster: two shapes within
noise of each other would otherwise alternate, and leaving plain decoding for a draft can cost such
a refresh. A step that first refreshed the drafter is charged ``1 / refresh_steps`` of the refresh:
a switch that wins holds for at least a retry interval, so charging it whole to one step (as
before) made a draft that pays only a few percent per step look many times slower than it is, and
the controller never left plain decoding for it. Costs are measured, not modelled: CUDA-event time
per graph replay on the GPU, wall time on the CPU. Greedy steps and steps with a sampled row keep
separate statistics: acceptance differs by far between them (measured on the H100, chain:4 on the
demo pair: 1.10x plain greedy, 0.66x at T=1), and a controller that carried a greedy run's numbers
into a sampled one (or back) paid for relearning each time the traffic changed.

The budget is one for all shapes: every step off the current shape (a first look or a retry) is charged
what it lost against the current shape (its seconds and refresh, less its tokens at the current rate),
and a retry or first look starts only while that total plus its own expected loss stays within the
budget's fraction of the clock (per-shape budgets added up: three drafted shapes lost ~6 % of a run).
With an ``explore_window`` of N steps, both sides fade by 1 - 1/N a step, so the budget is a fraction of about
the last N steps' time: a budget counted over the engine's whole life was banked through quiet stretches and then
spent in one short run (H200, trained pair at batch 4: runs that spent it were 0.96-0.97x plain, BENCHMARKS.md §0u).

Moving from plain decoding onto a draft on merit prices the drafter refresh it pays (one per running sequence)
as ``refresh_steps`` of the draft's steps share it: at batch 4 a chain:1 measured 12 % faster than plain per step
was taken, and with four refreshes per move it lost.

Priors (``prime``): the engine times each step graph when it captures it, so with CUDA graphs every
shape's step cost is known before its first step, and a new engine over the same drafter starts from
the acceptance (tau) the previous one measured, since acceptance is the drafter's and the traffic's,
not the batch size's. Plain decoding's tau is exactly 1. With an ``explore_budget`` and known costs a
shape is first looked at only when it could win at all (``(depth + 1) / cost`` above the best rate)
and when its loss if nothing were accepted fits the budget: measured on the H100 (batch 4-64),
exploring every shape at once cost auto 5-20 % of short runs in which no draft could beat plain
decoding. Without known costs every shape is measured first, as before.

Chains share their acceptance (``DepthAcceptance``): a chain step that reports each sequence's accepted
length updates per-depth rates, and every chain no deeper than the measured depths takes its tau from
them, so a chain:4 step measures chain:1-3 too (measured on the H100, trained pair: auto's 8 chain:2
steps over a 1000-step run put it at tau 2.6 and its 38 chain:4 steps at 2.7, too few of either to
trust, where pooled they tell both).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.depth_acceptance import DepthAcceptance


@dataclass
class _Running:
    tau: float
    cost: float
    seen: int = 0
    last_step: int = -1
    retry_every: int = 256
    retrying: bool = False
    samples: int = 0  # sequence-steps observed (a step of B running sequences is B samples)
    retry_samples: int = 0  # sequence-steps of the retry under way
    last_clock: float = 0.0  # the controller's clock (measured seconds) at its last sample
    known_cost: bool = False  # ``cost`` came from a timed replay before this shape's first step
    primed: bool = False  # ``tau`` came from an earlier engine's measurement
    pooled: bool = False  # ``tau`` follows the per-depth acceptance of every chain step (chains only)
    shape: TreeShape | None = None  # whose statistics these are (the chooser's loops walk rows, not a dict)
    measured: bool = False  # ShapeChooser.measured, kept up to date where its inputs change (read every step)


class ShapeChooser:
    """Chooses among ``shapes`` by measured tokens per second; ``alpha``: weight of the newest sample (0.03: acceptance
    comes in runs, and a mean that follows the last ~10 steps left a draft for plain decoding in each bad run and came
    back only at the next retry; on recorded traces of the trained pair that cost auto 5-13 % of the best chain's
    speed against 0.1, ``bench/goodput_replay.py``).
    One sampling mode's statistics (``GoodputController`` keeps one per mode)."""

    def __init__(self, shapes: list[TreeShape], alpha: float = 0.03, retry_every: int = 256,
                 max_retry_every: int = 4096, hysteresis: float = 0.05, refresh_steps: int = 32,
                 min_samples: int = 4, explore_budget: float | None = None, explore_window: int | None = None):
        if not shapes:
            raise ValueError("the goodput controller needs at least one shape")
        self.shapes = list(shapes)
        self.alpha = alpha
        self.retry_every = retry_every
        self.max_retry_every = max(retry_every, max_retry_every)
        # optimistic start: a tree of depth D may emit up to D + 1 tokens; every shape is tried early
        self.stats = {s: _Running(tau=float(s.max_depth + 1), cost=1.0, retry_every=retry_every, shape=s)
                      for s in self.shapes}
        self._rows = list(self.stats.values())  # the per-step loops walk these: no shape hashing in them
        # first looks in this order: of the chains that fit, the deepest (its steps measure every shorter chain)
        self._look_order = sorted(self._rows, key=lambda r: -r.shape.max_depth if r.shape.kind == "chain" else 0)
        # a chain's retry runs the deepest chain: its steps measure every shorter one (per-depth acceptance)
        self._deepest_chain = max((s for s in self.shapes if s.kind == "chain"), key=lambda s: s.max_depth, default=None)
        self.hysteresis = hysteresis
        self.refresh_steps = refresh_steps
        self.min_samples = max(1, int(min_samples))
        if explore_budget is not None and not 0.0 < explore_budget <= 1.0:
            raise ValueError(f"explore_budget must be in (0, 1], got {explore_budget}")
        self.explore_budget = explore_budget
        if explore_window is not None and explore_window < 1:
            raise ValueError(f"explore_window must be at least one step, got {explore_window}")
        self.fade = 1.0 - 1.0 / explore_window if explore_window else 1.0  # per step, of the budget's two sides
        self.clock = 0.0  # measured seconds of every step observed so far
        self.recent = 0.0  # the same seconds fading by ``fade`` a step: what the budget is a fraction of
        self.explore_spent = 0.0  # seconds lost by steps off the current shape (first looks, retries), fading alike
        self.refresh_s = 0.0  # running mean of the drafter refresh per refreshed sequence (a retry from plain pays it)
        self.refresh_guess = 0.0  # what refreshing one sequence is taken to cost before one was measured (the engine)
        self.current: TreeShape | None = None  # the shape chosen on merit (not as a retry) last time
        self.depths = DepthAcceptance(self.min_samples)  # acceptance per depth, pooled over chain steps
        self._any_known_cost = False  # some shape's cost came from a timed replay (``prime``)
        self.burst: list[TreeShape] = []  # retries still to run in this burst, oldest first
        self.step = 0
        self.rows = 1  # sequences in the step being chosen (``choose``): a burst is as many steps as give min_samples

    def rate(self, shape: TreeShape) -> float:
        """Expected tokens per second per sequence of ``shape``, as measured so far."""
        return self._rate(self.stats[shape])

    @staticmethod
    def _rate(r: _Running) -> float:
        return r.tau / r.cost if r.cost > 0 else 0.0

    def prime(self, shape: TreeShape, tau: float | None = None, cost: float | None = None,
              retry_every: int | None = None) -> None:
        """Start ``shape`` from a known step ``cost`` (seconds, a timed replay) and/or ``tau`` and ``retry_every``
        (another engine's measurement and back-off); ignored once the shape has steps of its own, and tau for plain
        decoding (exactly 1)."""
        if shape not in self.stats:
            return
        r = self.stats[shape]
        if r.samples:
            return
        if cost is not None and cost > 0 and not r.known_cost:
            r.cost, r.known_cost = float(cost), True
            self._any_known_cost = True
        if tau is not None and shape.kind != "none":
            r.tau, r.primed = float(tau), True
        if retry_every is not None:
            r.retry_every = min(max(int(retry_every), self.retry_every), self.max_retry_every)
        self._remeasure(r)

    @property
    def refresh_cost(self) -> float:
        """The drafter refresh of one sequence that a step leaving plain decoding pays: the measured mean per
        sequence, else ``refresh_guess``. A step of ``rows`` sequences pays it ``rows`` times (``_expected_loss``)."""
        return self.refresh_s or self.refresh_guess

    def measured(self, shape: TreeShape) -> bool:
        """Whether ``shape``'s rate rests on numbers: its own ``min_samples`` steps, or a known cost with a
        primed tau (plain decoding's tau is exact)."""
        return self.stats[shape].measured

    def _remeasure(self, r: _Running) -> None:
        """Recompute ``r.measured`` (after its steps, cost, prime or pooling changed)."""
        r.measured = r.samples >= self.min_samples or (r.known_cost and (r.primed or r.pooled or r.shape.kind == "none"))

    def _best_row(self, known: list[_Running] | None = None) -> _Running:
        """The row with the best rate among ``known`` (the measured rows, found here if not given), or among
        every row while none is measured."""
        if known is None:
            known = [r for r in self._rows if r.measured]
        return max(known or self._rows, key=self._rate)

    def best(self) -> TreeShape:
        """The measured shape with the best rate (any shape while none is measured)."""
        return self._best_row().shape

    def burst_steps(self) -> int:
        """Steps of a first look or a retry: enough for ``min_samples`` sequence-steps at ``rows`` sequences a step.

        A step's tau is the mean over its sequences, so at batch 64 one step measures as much as 64 steps of one
        sequence; counted in steps, the first look at a draft that costs 2.7 steps was priced at four such steps,
        and a 128-token run at the 2.7B shape never afforded it (BENCHMARKS.md §0r)."""
        return max(1, -(-self.min_samples // self.rows))

    def choose(self, rows: int = 1) -> TreeShape:
        """The shape of the next step, which runs ``rows`` sequences."""
        self.step += 1
        self.rows = max(1, int(rows))
        if self.burst:
            return self._pop_burst()
        known = [r for r in self._rows if r.measured]
        if self.explore_budget is not None and self._any_known_cost:
            if len(known) < len(self._rows):
                first = self._first_look(known)
                if first is not None:
                    return first
        else:
            for r in self._rows:  # measure every shape before trusting the numbers
                if r.samples < self.min_samples:
                    return r.shape
        best = self._best_row(known)
        rate = self._rate(best)
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
        # the margin guards only a move onto a draft: leaving one for plain decoding costs nothing, and a draft that
        # fell a few % behind plain was otherwise kept (H100, trained pair at batch 4: chain:3 at 0.96x plain's
        # rate ran 33 of a run's 218 steps, BENCHMARKS.md §0r)
        margin = self.hysteresis if best.shape.kind != "none" else 0.0
        if best.shape.kind != "none":  # a move from plain decoding pays its drafter refresh
            cost = self._move_cost(best)
            rate = best.tau / cost if cost > 0 else 0.0
        if self.current is not None and rate <= (1 + margin) * self.rate(self.current):
            return self.current
        self.current = best.shape
        return best.shape

    def ran_instead(self, shape: TreeShape) -> None:
        """The engine ran ``shape`` instead of the choice on merit (a draining batch, ``verifier/decode/drain.py``):
        it becomes the current shape, so its steps are no exploration charged to the budget."""
        self.current = shape

    def _pop_burst(self) -> TreeShape:
        shape = self.burst.pop(0)
        r = self.stats[shape]
        if not r.retrying and self.measured(shape):  # a first look's steps are plain samples, not a retry
            r.retrying, r.retry_samples = True, 0
        return shape

    def _first_look(self, known: list[_Running]) -> TreeShape | None:
        """With known costs and a budget: the shape to measure now, if any (see the module docstring); ``known``:
        the measured shapes' rows.

        Plain decoding and shapes without a known cost are measured first, as without a budget. A first look
        runs ``min_samples`` steps (a burst) and starts only if its loss, were no drafted token accepted, fits the
        budget; ``observe`` then charges what its steps actually lost. A tree no deeper than the measured chains is
        looked at only if it could win (``_could_win``) at the acceptance of the chain of its depth: a tree of the
        same depth rarely accepts far more, and a beam:4x2 looked at on its ceiling alone cost a batch-4 run of the
        trained pair 5 % (H200, §0u)."""
        unlooked = False
        for r in self._rows:
            if r.measured:
                continue
            if r.shape.kind == "none" or not r.known_cost:  # measured first, as without a budget
                return r.shape
            unlooked = unlooked or not r.samples
        if not unlooked:  # every shape measured or under way: nothing to look at (the usual case, kept cheap)
            return None
        rate = self._rate(self._best_row(known))
        chain_waits = False  # a deeper chain that could win waits for the budget: no shorter chain goes first
        for r in self._look_order:
            s = r.shape
            if r.measured or r.samples or (s.max_depth + 1) / r.cost <= rate or (chain_waits and s.kind == "chain"):
                continue  # measured, under way, or it could not win with every drafted token accepted
            if s.kind != "chain" and self.depths.known(s.max_depth) and not self._could_win(
                    r, rate, self.depths.tau(s.max_depth)):
                continue  # the chain of its depth says it would not win
            loss = self._expected_loss(r, 1.0, rate)  # as if no drafted token were accepted
            if self.explore_spent + loss <= self.explore_budget * self.recent:
                self.burst = [s] * (self.burst_steps() - 1)
                return s
            chain_waits = chain_waits or s.kind == "chain"
        return None

    def _due(self, shape: TreeShape, best: TreeShape, frac: float = 1.0) -> bool:
        """Whether ``shape`` is ``frac`` of the way to its retry: its retry interval in steps has passed and,
        with an ``explore_budget``, enough measured time that the retry's expected loss against the ``best``
        shape (``min_samples`` steps at its last known rate) stays within that fraction of the run."""
        return self._due_row(self.stats[shape], self.rate(best), frac)

    def _due_row(self, r: _Running, best_rate: float, frac: float = 1.0) -> bool:
        if self.step - r.last_step <= r.retry_every * frac:
            return False
        if self.explore_budget is None:
            return True
        run = self._retried_row(r)
        if not self._could_win(run, best_rate):
            return False
        loss = self._expected_loss(run, run.tau, best_rate)
        return (self.clock - r.last_clock >= frac * loss / self.explore_budget
                and self.explore_spent + frac * loss <= self.explore_budget * self.recent)

    def _could_win(self, r: _Running, best_rate: float, tau: float | None = None) -> bool:
        """With a budget, whether a retry of ``r`` could find a shape worth moving to: one that beats ``best_rate`` by
        the hysteresis if its acceptance (``tau``, default its own) rose halfway to its ceiling (every drafted token
        accepted), the move's refresh priced as ``choose`` prices it. A retry only re-measures acceptance (costs are
        timed), so one that could not win even then is not worth its refresh: on the trained pair at batch 4 such
        retries, one per run, made auto 0.96-0.97x plain (H200, §0u)."""
        if r.shape.kind == "none":
            return True
        tau = r.tau if tau is None else tau
        tau += 0.5 * max(0.0, r.shape.max_depth + 1 - tau)
        return tau / self._move_cost(r) > (1 + self.hysteresis) * best_rate

    def _move_cost(self, r: _Running) -> float:
        """``r``'s step cost as a move onto its draft shape pays it: from plain decoding, plus the drafter refresh of
        every running sequence, shared by ``refresh_steps`` of the draft's steps."""
        if self.current is not None and self.current.kind == "none":
            return r.cost + self.refresh_cost * self.rows / self.refresh_steps
        return r.cost

    def _retried_row(self, r: _Running) -> _Running:
        """The row whose shape a retry of ``r`` runs: a chain's retry runs the deepest chain (it measures every
        shorter one), so that is what it costs. A retry of chain:1 priced as chain:1 ran chain:4 at four times its
        step cost (H200, trained pair at batch 4: one such retry per run made auto 0.97x plain, §0u)."""
        if r.shape.kind == "chain" and self._deepest_chain is not None:
            return self.stats[self._deepest_chain]
        return r

    def _expected_loss(self, r: _Running, tau: float, rate: float) -> float:
        """Seconds a burst (``burst_steps``) of ``r``'s shape at ``tau`` loses against ``rate`` tokens per second, plus
        the drafter refresh when they leave plain decoding (first looks and retries alike)."""
        loss = self.burst_steps() * max(0.0, r.cost - (tau / rate if rate > 0 else 0.0))
        if r.shape.kind != "none" and self.current is not None and self.current.kind == "none":
            # leaving plain decoding refreshes every running sequence's stale drafter first: at batch 16 and 64 a
            # retry priced with one sequence's refresh refreshed all of them, and the run that paid it was 6-8 %
            # slower than plain (H200, trained pair, BENCHMARKS.md §0s)
            loss += self.refresh_cost * self.rows
        return loss

    def observe(self, shape: TreeShape, tau: float, seconds: float, refresh_s: float = 0.0,
                emitted: list[int] | None = None, refreshed: int = 1) -> None:
        """One step of ``shape`` emitted ``tau`` tokens per sequence and took ``seconds``, after a drafter
        refresh of ``refreshed`` sequences that took ``refresh_s`` (charged in part, see the module docstring).
        ``emitted``: the tokens each sequence emitted (a chain step's per-depth acceptance; optional)."""
        self.explore_spent *= self.fade
        if self.current is not None and shape != self.current:  # exploring: what it lost against the current shape
            rate = self.rate(self.current)
            self.explore_spent += max(0.0, seconds + refresh_s - (tau / rate if rate > 0 else 0.0))
        if refresh_s > 0:
            per = refresh_s / max(1, refreshed)
            self.refresh_s = per if self.refresh_s == 0 else self.refresh_s + self.alpha * (per - self.refresh_s)
        seconds += refresh_s / self.refresh_steps
        r = self.stats[shape]
        rows = len(emitted) if emitted else 1
        if r.samples < self.min_samples:  # the plain mean of the first samples (sequence-steps)
            a = rows / (r.samples + rows)
        elif r.retrying:  # a retry's samples weigh more: what the running mean holds is old (worth one sample)
            r.retry_samples += rows
            a = rows / (r.retry_samples + 1)
        else:
            a = self.alpha
        pooled = bool(emitted) and shape.kind == "chain"
        if pooled:  # a retry's weight, else the running one (a first look adds depths)
            self.depths.observe(shape.max_depth, [n - 1 for n in emitted], a if r.retrying else self.alpha)
        r.tau += a * (tau - r.tau)
        r.cost += a * (seconds - r.cost)
        r.seen += 1
        r.samples += rows
        self._remeasure(r)
        r.last_step = self.step
        self.clock += seconds
        self.recent = self.recent * self.fade + seconds
        r.last_clock = self.clock
        if pooled:
            self._pool_chains(shape)
        if r.retrying and r.retry_samples >= self.min_samples:
            r.retrying = False
            self._back_off(r)

    def _back_off(self, r: _Running) -> None:
        """A retry of ``r``'s shape ended: a winner's retry interval resets, a loser's doubles (up to the cap).
        A chain's retry measured every shorter chain too, so they share one interval: kept apart, chain:1's stayed at
        the base and called the deepest chain's retry back every interval however often it lost."""
        shape, best = r.shape, self.best()
        if shape.kind != "chain":
            r.retry_every = self.retry_every if best == shape else min(2 * r.retry_every, self.max_retry_every)
            return
        chains = [c for c in self._rows if c.shape.kind == "chain" and c.shape.max_depth <= shape.max_depth]
        won = best.kind == "chain" and best.max_depth <= shape.max_depth
        every = self.retry_every if won else min(2 * max(c.retry_every for c in chains), self.max_retry_every)
        for c in chains:
            c.retry_every = every

    def _pool_chains(self, stepped: TreeShape | None = None) -> None:
        """Every chain whose depths are measured takes its tau from the per-depth rates; those no deeper than
        the ``stepped`` chain (if any) were measured just now (their retry clock restarts)."""
        for r in self._rows:
            s = r.shape
            if s.kind == "chain" and self.depths.known(s.max_depth):
                r.tau, r.pooled = self.depths.tau(s.max_depth), True
                self._remeasure(r)
                if stepped is not None and s != stepped and s.max_depth <= stepped.max_depth:
                    r.last_step, r.last_clock = self.step, self.clock

    def table(self) -> list[dict]:
        """What the controller believes now, shape by shape."""
        return [{"shape": str(s), "tau": r.tau, "cost_ms": 1e3 * r.cost, "tokens_per_s": self.rate(s), "steps": r.seen,
                 "retry_every": r.retry_every, "measured": self.measured(s), "known_cost": r.known_cost,
                 "primed": r.primed, "pooled": r.pooled}
                for s, r in self.stats.items()]

    def learned(self) -> dict:
        """``{shape: (tau, retry_every)}`` of every drafted shape with numbers behind it (its own steps or a prime),
        for a new engine: a draft that kept losing its retries is retried as rarely there."""
        return {s: (r.tau, r.retry_every) for s, r in self.stats.items()
                if s.kind != "none" and (r.samples >= self.min_samples or r.primed or r.pooled)}


class GoodputController:
    """Goodput control for an engine: a ``ShapeChooser`` per sampling mode (``sampled``: the step has a row
    with temperature > 0), made when that mode first runs. ``knobs`` go to every ``ShapeChooser``; the sampled
    mode's running means weigh the newest sample ``sampled_alpha``. Sampled acceptance varies step to step by the
    draws more than it comes in runs, and a draft that looked good after a lucky retry (4 steps) was then run for
    as long as a slow mean remembered that retry: on the H100 (trained pair, T=1) auto ran at 0.95-0.99x plain with
    0.03 against 0.97-0.99x with 0.1 (BENCHMARKS.md §0o)."""

    def __init__(self, shapes: list[TreeShape], sampled_alpha: float = 0.1, **knobs):
        self.shapes = list(shapes)
        self._knobs = knobs
        self._sampled_alpha = sampled_alpha
        self._refresh_guess = 0.0  # guess_refresh's value, for modes made later
        self.modes = {False: ShapeChooser(self.shapes, **knobs)}

    def mode(self, sampled: bool = False) -> ShapeChooser:
        if sampled not in self.modes:
            knobs = {**self._knobs, "alpha": self._sampled_alpha} if sampled else self._knobs
            self.modes[sampled] = ShapeChooser(self.shapes, **knobs)
            self.modes[sampled].refresh_guess = self._refresh_guess
        return self.modes[sampled]

    @property
    def stats(self) -> dict:
        """The greedy mode's running statistics per shape."""
        return self.modes[False].stats

    @property
    def current(self) -> TreeShape | None:
        """The greedy mode's shape chosen on merit last."""
        return self.modes[False].current

    def choose(self, sampled: bool = False, rows: int = 1) -> TreeShape:
        """The next step's shape in the ``sampled`` mode, for a step of ``rows`` running sequences."""
        return self.mode(sampled).choose(rows)

    def prime(self, shape: TreeShape, sampled: bool, tau: float | None = None, cost: float | None = None,
              retry_every: int | None = None) -> None:
        """``ShapeChooser.prime`` in the ``sampled`` mode's statistics."""
        self.mode(sampled).prime(shape, tau=tau, cost=cost, retry_every=retry_every)

    def learned(self) -> dict:
        """``{(sampled, shape): (tau, retry_every)}`` over every mode that has run (``ShapeChooser.learned``)."""
        return {(sampled, s): v for sampled, chooser in self.modes.items() for s, v in chooser.learned().items()}

    def guess_refresh(self, seconds: float) -> None:
        """Take refreshing one sequence's drafter to cost ``seconds`` in every mode (and modes made later) until a
        refresh is measured."""
        self._refresh_guess = float(seconds)
        for chooser in self.modes.values():
            chooser.refresh_guess = self._refresh_guess

    def observe(self, shape: TreeShape, tau: float, seconds: float, refresh_s: float = 0.0,
                sampled: bool = False, emitted: list[int] | None = None, refreshed: int = 1) -> None:
        self.mode(sampled).observe(shape, tau, seconds, refresh_s, emitted, refreshed)

    def learned_depths(self) -> dict:
        """``{sampled: DepthAcceptance}`` (copies) of every mode whose chains measured some depth."""
        return {sampled: copy.deepcopy(chooser.depths) for sampled, chooser in self.modes.items()
                if chooser.depths.rate}

    def prime_depths(self, depths: dict) -> None:
        """Start each mode's per-depth chain acceptance from ``depths`` (``learned_depths`` of another engine)."""
        for sampled, rates in depths.items():
            chooser = self.mode(sampled)
            chooser.depths.copy_from(rates)
            chooser._pool_chains()

    def table(self) -> list[dict]:
        """What the controller believes now, per sampling mode that has run and shape."""
        return [{**row, "sampled": sampled} for sampled, chooser in sorted(self.modes.items())
                for row in chooser.table()]
