"""Capture every step graph an engine may need before traffic arrives, with short throw-away generations.

For each tree shape, greedy and sampled: a plain step with the drafter stale, a draft, a plain step feeding the
drafter's backlog, and a catch-up followed by a draft. Goodput statistics start afresh afterwards, from the step
costs timed at capture, the acceptance measured before the throw-away runs, and (when the drafter is deferred) one
timed drafter refresh, which is what leaving plain decoding costs until a refresh is measured.
"""

from __future__ import annotations

from stree.protocols.sampling import SamplingParams
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.request import Request

PLAIN = TreeShape.parse("none")


def warm_up_engine(engine) -> int:
    """Capture ``engine``'s step graphs (nothing without CUDA graphs, for host drafters, or while it has work);
    returns the graphs held."""
    if engine.cuda:
        engine.warm_up_prefill()
    if not engine.graphs.enabled or engine.host or engine.has_work:
        return len(engine.graphs)
    if engine.goodput is not None:  # what it measured before (real traffic) outlives the throw-away runs
        engine.chooser.priors.remember(engine.goodput)
    trees = [s for s in engine.shapes if s.kind != "none"]
    patterns = [[PLAIN, s, PLAIN, s] for s in trees] if trees else [[PLAIN]]
    try:
        for params in (SamplingParams(), SamplingParams(temperature=1.0)):
            for pattern in patterns:
                engine.chooser.forced = list(pattern)
                steps = len(pattern) * (max(s.max_depth for s in pattern) + 1)
                engine.run([Request([0, 0], max_new_tokens=steps, params=params)])
    finally:
        engine.chooser.forced = None
    engine.warmed_up = True
    if engine.goodput is not None:
        if engine.drafter is not None and engine.drafter.defer:
            engine.chooser.priors.refresh_s = engine.drafter.time_refresh(engine.max_seqlen, engine.cuda)
        engine.chooser.goodput = engine.chooser.controller()
    engine.metrics.clear()
    engine.step_host_s.clear()
    return len(engine.graphs)
