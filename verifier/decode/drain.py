"""A draining batch finishes with its slowest sequence: draft only while that helps the sequence that ends last.

Goodput control compares tokens per second per sequence (tau / cost), which is what matters while new requests
wait to take freed slots. When nothing waits, the running set is done when its last sequence is, and drafts
help sequences unevenly: plain decoding finishes equal-length sequences together, a draft finishes the
well-predicted ones early and leaves the poorly predicted ones to run on with a costlier step. Measured on the
H100 (trained pair, batch 64, 128 tokens each, BENCHMARKS.md §0r): chain:3 at tau 2.31 and 2.08x plain's step cost
was 11 % ahead by tau / cost, yet its run took 72 steps where the mean sequence needed 51, and auto ran at
0.79x plain. So when the batch drains, the engine compares the time to finish the whole running set both ways,
with each sequence's own acceptance (shrunk towards the batch mean while it has few draft steps).
"""

from __future__ import annotations

from typing import Sequence

PRIOR_STEPS = 4.0  # draft steps' worth of the batch mean in each sequence's acceptance estimate


def sequence_taus(tau: float, accepted: Sequence[int], draft_steps: Sequence[int],
                  prior_steps: float = PRIOR_STEPS) -> list[float]:
    """Each sequence's expected tokens per step of a draft whose batch-wide tau is ``tau``.

    ``accepted[i]``: drafted tokens sequence i accepted so far over ``draft_steps[i]`` draft steps. Its accepted
    tokens per step, shrunk towards the batch's by ``prior_steps``, relative to the batch's, scales the draft's
    ``tau - 1``: a sequence that accepts half the batch mean gets half the draft's gain.
    """
    total_steps = sum(draft_steps)
    if total_steps == 0:
        return [tau] * len(accepted)
    mean = sum(accepted) / total_steps
    if mean <= 0:
        return [1.0] * len(accepted)
    out = []
    for a, n in zip(accepted, draft_steps):
        own = (a + prior_steps * mean) / (n + prior_steps)
        out.append(1.0 + (tau - 1.0) * own / mean)
    return out


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
