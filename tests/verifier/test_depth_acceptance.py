"""Per-depth chain acceptance: one chain's steps tell every shorter chain's tau, exactly as its own steps would."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st
from stree.verifier.decode.depth_acceptance import DepthAcceptance


def test_tau_follows_the_rates_of_each_depth():
    rates = DepthAcceptance(min_samples=1)
    rates.rate, rates.samples = [0.8, 0.5, 0.25], [1, 1, 1]
    assert rates.tau(1) == pytest.approx(1.8)
    assert rates.tau(3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    with pytest.raises(ValueError, match="depth 4"):
        rates.tau(4)


def test_a_step_tries_each_depth_up_to_one_past_its_accepted_run():
    """Sequences that accepted 0, 1 and 3 of 3 drafted tokens: depth 1 tried by 3 (2 passed), depth 2 by 2
    (1 passed), depth 3 by 1 (1 passed). Each sequence that tried a depth is one sample of it."""
    rates = DepthAcceptance(min_samples=4)
    rates.observe(3, [0, 1, 3], weight=0.1)
    assert rates.rate == pytest.approx([2 / 3, 1 / 2, 1.0]) and rates.samples == [3, 2, 1]
    assert not rates.known(1)
    rates.observe(3, [0, 0], weight=0.1)  # nobody passed depth 1: depths 2 and 3 were not tried
    assert rates.rate == pytest.approx([2 / 5, 1 / 2, 1.0]) and rates.samples == [5, 2, 1]  # 2 of 5 samples passed
    assert rates.known(1) and not rates.known(2)
    rates.observe(3, [3], weight=0.1)  # depth 1 is past min_samples: the given weight; depth 2 still a plain mean
    assert rates.rate[0] == pytest.approx(2 / 5 + 0.1 * (1 - 2 / 5))
    assert rates.rate[1] == pytest.approx(2 / 3) and rates.samples == [6, 3, 2]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 4))
def test_a_deep_chain_s_steps_give_a_shorter_chain_its_exact_mean(seed, short, batch):
    """Greedy acceptance of a draft token does not depend on how deep the chain goes on, so the plain mean a
    chain:K run gives chain:k (k < K) through per-depth rates equals chain:k's own mean on the same sequences,
    at any number of sequences per step (each sequence that tried a depth is one sample of it)."""
    rng = random.Random(seed)
    first_wrong = [[min(rng.expovariate(0.6), 9) for _ in range(batch)] for _ in range(50)]
    rates = DepthAcceptance(min_samples=10**6)  # plain means throughout
    for row in first_wrong:
        rates.observe(4, [min(int(w), 4) for w in row], weight=0.1)
    own = sum(1 + min(int(w), short) for row in first_wrong for w in row) / (len(first_wrong) * batch)
    assert rates.tau(short) == pytest.approx(own)
    assert 1.0 <= rates.tau(short) <= rates.tau(4) <= 5.0
