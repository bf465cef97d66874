"""Distribution checks for lossless decoding: exact law of short sampled sequences and a chi-square test.

Speculative sampling must emit sequences with exactly the law of plain sampling from the target;
these helpers compute that law for the first few tokens and test samples against it.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable, Sequence

import scipy.stats
import torch

NextProbs = Callable[[tuple], Sequence[float]]


def exact_sequence_distribution(
    next_probs: NextProbs, context: Sequence[int], length: int, min_prob: float = 0.0
) -> dict[tuple, float]:
    """Exact P(first ``length`` tokens) when each token is drawn from ``next_probs(context + so_far)``.

    ``next_probs`` maps a token tuple (the whole context so far) to a probability vector (already
    warped: temperature/top-k/top-p). Branches below ``min_prob`` are dropped (keep it 0 for exact).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    law = {(): 1.0}
    context = tuple(int(t) for t in context)
    for _ in range(length):
        grown = {}
        for seq, mass in law.items():
            probs = torch.as_tensor(next_probs(context + seq), dtype=torch.float64)
            probs = probs / probs.sum()
            for tok in torch.nonzero(probs > 0).flatten().tolist():
                m = mass * float(probs[tok])
                if m > min_prob:
                    grown[seq + (tok,)] = m
        law = grown
    return law


def chisquare_pvalue(
    samples: Iterable[Hashable], expected: dict[Hashable, float], min_expected: float = 5.0
) -> float:
    """Pearson chi-square p-value of ``samples`` against the law ``expected`` (probabilities).

    Cells expecting fewer than ``min_expected`` counts are merged into one bucket (folded into the
    smallest regular cell if the bucket itself stays small). A sample the law gives probability 0
    returns 0.0: it is impossible under the target, so that is a certain rejection.
    """
    counts = Counter(samples)
    n = sum(counts.values())
    if n == 0:
        raise ValueError("chisquare_pvalue: no samples")
    total = sum(expected.values())
    probs = {k: v / total for k, v in expected.items() if v > 0}
    if any(k not in probs for k in counts):
        return 0.0
    cells = sorted(probs, key=lambda k: probs[k], reverse=True)
    big = [k for k in cells if n * probs[k] >= min_expected]
    small = [k for k in cells if n * probs[k] < min_expected]
    obs = [counts.get(k, 0) for k in big]
    exp = [n * probs[k] for k in big]
    if small:
        obs_small = sum(counts.get(k, 0) for k in small)
        exp_small = sum(n * probs[k] for k in small)
        if exp_small >= min_expected or not big:
            obs.append(obs_small)
            exp.append(exp_small)
        else:
            obs[-1] += obs_small
            exp[-1] += exp_small
    if len(obs) < 2:
        return 1.0
    exp_sum = sum(exp)
    exp = [e * n / exp_sum for e in exp]  # guard scipy's sum check against rounding
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def assert_same_distribution(
    samples: Sequence[Hashable], expected: dict[Hashable, float], alpha: float = 1e-3
) -> float:
    """Fail (with the worst cells) if the chi-square test rejects at level ``alpha``; return the p-value."""
    pvalue = chisquare_pvalue(samples, expected)
    if pvalue < alpha:
        counts = Counter(samples)
        n = len(samples)
        total = sum(expected.values())
        keys = set(counts) | set(expected)
        gaps = sorted(
            keys, key=lambda k: -abs(counts.get(k, 0) - n * expected.get(k, 0.0) / total)
        )[:5]
        worst = ", ".join(
            f"{k}: seen {counts.get(k, 0)} vs expected {n * expected.get(k, 0.0) / total:.1f}"
            for k in gaps
        )
        raise AssertionError(
            f"samples do not follow the expected law (chi-square p={pvalue:.2e} < {alpha}); {worst}"
        )
    return pvalue
