"""Goodput control (SmartSpec's idea): each step, the tree shape with the most expected tokens per second.

For every candidate shape (plain decoding included) the controller keeps a running mean of the
tokens a step emits per sequence (tau, the bonus counted) and of what a step costs. Each shape is
first measured for ``min_samples`` steps (their plain mean): one step's tau is too noisy to decide on
(measured on the H100: a single exploring step put chain:4 at tau 1.5 where it averages 2.9, so auto
kept plain decoding where chain:4 was 1.10-1.15x faster). Then it picks ``argmax tau / cost``; a
shape not tried for a while is retried for ``min_samples`` steps (their mean then outweighs the old
estimate 4 to 1), so a change in acceptance (a new prompt, a new domain) is noticed. A retry that
loses again doubles that shape's retry interval (up to ``max_retry_every``), so a drafter that never
pays costs ever less; one that wins resets it. Retries
come in bursts: when one shape is due, every shape at least half-way to its own retry is retried in
the steps right after it, since they share one refresh of the engine's stale drafter slots. The
controller leaves its current shape only for one at least ``hysteresis`` faster: two shapes within
noise of each other would otherwise alternate, and leaving plain decoding for a draft can cost such
a refresh. A step that first refreshed the drafter is charged ``1 / refresh_steps`` of the refresh:
a switch that wins holds for at least a retry interval, so charging it whole to one step (as
before) made a draft that pays only a few percent per step look many times slower than it is, and
the controller never left plain decoding for it. Costs are measured, not modelled: CUDA-event time
per graph replay on the GPU, wall time on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from stree.protocols.tree_shape import TreeShape


@dataclass
class _Running:
    tau: float
    cost: float
    seen: int = 0
    last_step: int = -1
    retry_every: int = 256
    retrying: bool = False
    retry_seen: int = 0  # samples of the retry under way


class GoodputController:
    """Chooses among ``shapes`` by measured tokens per second; ``alpha``: weight of the newest sample."""

    def __init__(self, shapes: list[TreeShape], alpha: float = 0.1, retry_every: int = 256,
                 max_retry_every: int = 4096, hysteresis: float = 0.05, refresh_steps: int = 32,
                 min_samples: int = 4):
        if not shapes:
            raise ValueError("the goodput controller needs at least one shape")
        self.shapes = list(shapes)
        self.alpha = alpha
        self.retry_every = retry_every
        self.max_retry_every = max(retry_every, max_retry_every)
        # optimistic start: a tree of depth D may emit up to D + 1 tokens; every shape is tried early
        self.stats = {s: _Running(tau=float(s.max_depth + 1), cost=1.0, retry_every=retry_every) for s in self.shapes}
        self.hysteresis = hysteresis
        self.refresh_steps = refresh_steps
        self.min_samples = max(1, int(min_samples))
        self.current: TreeShape | None = None  # the shape chosen on merit (not as a retry) last time
        self.burst: list[TreeShape] = []  # retries still to run in this burst, oldest first
        self.step = 0

    def rate(self, shape: TreeShape) -> float:
        """Expected tokens per second per sequence of ``shape``, as measured so far."""
        r = self.stats[shape]
        return r.tau / r.cost if r.cost > 0 else 0.0

    def best(self) -> TreeShape:
        return max(self.shapes, key=self.rate)

    def choose(self) -> TreeShape:
        self.step += 1
        for s in self.shapes:  # measure every shape before trusting the numbers
            if self.stats[s].seen < self.min_samples:
                return s
        if not self.burst and any(self.step - r.last_step > r.retry_every for r in self.stats.values()):
            half = [s for s in self.shapes if s != self.current
                    and self.step - self.stats[s].last_step > self.stats[s].retry_every // 2]
            self.burst = [s for s in sorted(half, key=lambda s: self.stats[s].last_step)
                          for _ in range(self.min_samples)]
        if self.burst:
            shape = self.burst.pop(0)
            r = self.stats[shape]
            if not r.retrying:
                r.retrying, r.retry_seen = True, 0
            return shape
        best = self.best()
        if self.current is not None and self.rate(best) < (1 + self.hysteresis) * self.rate(self.current):
            return self.current
        self.current = best
        return best

    def observe(self, shape: TreeShape, tau: float, seconds: float, refresh_s: float = 0.0) -> None:
        """One step of ``shape`` emitted ``tau`` tokens per sequence and took ``seconds``, after a drafter
        refresh of ``refresh_s`` (charged in part, see the module docstring)."""
        seconds += refresh_s / self.refresh_steps
        r = self.stats[shape]
        if r.seen < self.min_samples:  # the plain mean of the first samples
            a = 1.0 / (r.seen + 1)
        elif r.retrying:  # a retry's samples weigh more: what the running mean holds is old
            a = 1.0 / (r.retry_seen + 2)
            r.retry_seen += 1
        else:
            a = self.alpha
        r.tau += a * (tau - r.tau)
        r.cost += a * (seconds - r.cost)
        r.seen += 1
        r.last_step = self.step
        if r.retrying and r.retry_seen >= self.min_samples:
            r.retrying = False
            r.retry_every = self.retry_every if self.best() == shape else min(2 * r.retry_every,
                                                                              self.max_retry_every)

    def table(self) -> list[dict]:
        """What the controller believes now, shape by shape."""
        return [{"shape": str(s), "tau": r.tau, "cost_ms": 1e3 * r.cost, "tokens_per_s": self.rate(s), "steps": r.seen,
                 "retry_every": r.retry_every}
                for s, r in self.stats.items()]
