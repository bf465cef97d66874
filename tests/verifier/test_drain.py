"""A draining batch: draft only while that finishes the running set sooner (verifier/decode/drain.py), exactly."""

from __future__ import annotations

import pytest

from stree.verifier.decode.drain import SlowestPrior, draft_finishes_later, sequence_taus
from stree.verifier.decode.loop import generate


def test_each_sequence_gets_the_drafts_gain_scaled_by_its_own_acceptance_shrunk_to_the_mean():
    # batch mean 1 accepted per step; the second sequence accepted nothing in 12 steps, the third never drafted
    taus = sequence_taus(3.0, [12, 0, 0], [12, 12, 0], prior_steps=4.0)
    assert taus[0] == pytest.approx(1 + 2 * (12 + 4 * 0.5) / 16 / 0.5)
    assert taus[1] == pytest.approx(1 + 2 * (4 * 0.5 / 16) / 0.5)  # a quarter of the gain: 4 prior steps of 16
    assert taus[2] == pytest.approx(3.0)  # no steps of its own: the batch's
    assert sequence_taus(2.5, [0, 0], [0, 0]) == [2.5, 2.5]
    assert sequence_taus(2.5, [0, 0], [3, 3]) == [1.0, 1.0]  # nothing ever accepted: no gain


def test_sequences_without_steps_of_their_own_take_the_prior_ratio():
    assert sequence_taus(3.0, [0, 0], [0, 0], prior_ratio=0.5) == [2.0, 2.0]
    # a sequence that matched the batch mean for 4 steps, with a prior of half the mean: halfway between
    assert sequence_taus(3.0, [4, 4], [4, 4], prior_ratio=0.5, prior_steps=4.0) == pytest.approx([2.5, 2.5])


def test_the_slowest_prior_is_the_low_quantile_of_finished_sequences_ratios():
    prior = SlowestPrior(keep=100, min_history=10, decay=1.0)
    assert prior.ratio(16) == 1.0  # no history: the batch mean
    prior.record(3, 8)  # no draft step observed yet: no mean to compare with
    assert not prior.ratios
    for _ in range(8):  # 8 draft steps of 10 sequences: a mean of 0.9 accepted per sequence-step
        prior.observe([0, 0, 1, 1, 1, 1, 1, 1, 1, 2])
    assert prior.mean == pytest.approx(0.9)
    for accepted in range(10):  # sequences that accepted 0..9 drafted tokens in 8 draft steps each
        prior.record(accepted, 8, prior_steps=0.0)
    assert sorted(prior.ratios) == pytest.approx([a / 8 / 0.9 for a in range(10)])
    assert prior.ratio(1) == 1.0  # one sequence is the batch
    assert prior.ratio(4) == pytest.approx(2 / 8 / 0.9)  # the 1/5 quantile of ten: the third lowest
    assert prior.ratio(64) == pytest.approx(0.0)  # the slowest of 64: below all ten
    prior.record(3, 0)  # no draft steps of its own: nothing to learn
    assert len(prior.ratios) == 10


def test_the_slowest_sequence_decides_when_the_batch_drains():
    # the trained pair at batch 64: chain:3 at 2.08x plain's cost; the batch mean tau 2.31 would win ...
    assert not draft_finishes_later([128] * 4, [2.31] * 4, 1.734, 0.833)
    # ... but a sequence that gets only half the draft's gain finishes last, later than plain decoding would
    assert draft_finishes_later([128] * 4, [2.31, 2.31, 2.31, 1.655], 1.734, 0.833)
    # near the end the longest remaining run decides: plain needs 5 more steps, the draft 2
    assert not draft_finishes_later([5, 1, 1], [3.0, 1.0, 1.0], 2.0, 1.0)
    assert not draft_finishes_later([], [], 2.0, 1.0)


# a chain:4's acceptance by depth on code prompts, as a trained 314M-parameter pair accepted it: P(depth >= d)
CHAIN_RATES = (0.541, 0.288, 0.198, 0.156)


def _chain_accepts(u: float) -> int:
    """Drafted tokens a chain step accepts for the uniform ``u``: a depth only after every shallower one."""
    return sum(u < r for r in CHAIN_RATES)


def _drain_rate(k: int, shrink_by_noise: bool, trials: int = 400) -> float:
    """How often 16 sequences that accept alike (i.i.d. draws of CHAIN_RATES), after ``k`` draft steps each, make
    the rule stop a draft that in truth finishes the batch sooner (tau ~2.2 at 1.46x plain's cost: about 60 draft
    steps against 128 plain ones)."""
    import random

    stops = 0
    for trial in range(trials):
        rng = random.Random(trial)
        per = [[_chain_accepts(rng.random()) for _ in range(k)] for _ in range(16)]
        prior = SlowestPrior(decay=1.0)
        for step in zip(*per):
            prior.observe(step)
        taus = sequence_taus(1.0 + prior.mean, [sum(p) for p in per], [k] * 16,
                             step_variance=prior.variance if shrink_by_noise else None)
        stops += draft_finishes_later([128 - 2 * k] * 16, taus, 8.39e-3, 5.75e-3)
    return stops / trials


def test_noise_alone_does_not_stop_a_draft_that_finishes_the_batch_sooner():
    """The lowest of 16 noisy rates is low by chance; shrinking by how far the rates spread beyond per-step noise
    keeps the draft (the fixed 4-step shrinkage stopped it in up to 1 of 10 decisions, for good)."""
    assert max(_drain_rate(k, shrink_by_noise=True) for k in (1, 2, 4, 8)) <= 0.03
    assert max(_drain_rate(k, shrink_by_noise=False) for k in (1, 2, 4, 8)) >= 0.08


def test_a_sequence_that_really_accepts_less_is_trusted_within_two_steps():
    """Three sequences accept all 3 drafted tokens every step, one none: the spread is no noise, so after two draft
    steps its own rate decides, and the draft at twice plain's cost would finish the batch later."""
    for k, later in ((1, False), (2, True), (5, True)):
        prior = SlowestPrior(decay=1.0)
        for _ in range(k):
            prior.observe([3, 3, 3, 0])
        taus = sequence_taus(1.0 + prior.mean, [3 * k] * 3 + [0], [k] * 4, step_variance=prior.variance)
        assert draft_finishes_later([30 - 4 * k] * 3 + [30 - k], taus, 2e-3, 1e-3) is later, k
    assert SlowestPrior().variance is None


def _fixed_costs(engine, cost: dict) -> None:
    """Make goodput control see fixed step costs (wall time on the CPU would make the test depend on the machine)."""
    observe = engine.goodput.observe

    def fixed(shape, tau, seconds, refresh_s=0.0, sampled=False, emitted=None, refreshed=1):
        observe(shape, tau, cost[str(shape)], 0.0, sampled=sampled, emitted=emitted)

    engine.goodput.observe = fixed


@pytest.mark.parametrize("registered", [4, 3])
def test_a_draining_batch_drafts_only_while_its_slowest_sequence_gains(models, registered):
    """Four sequences, nothing waiting, chain:3 at twice plain's cost. With every sequence's continuation known
    (tau 3 each) the draft runs to the end; with one unknown (it accepts ~nothing) the pooled tau still favours the
    draft, but that sequence would finish last, so the engine turns to plain steps. Output is plain greedy."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.verifier.decode.engine import Engine, Request

    target = models["hybrid"]
    prompts = [[3, 1, 4], [9, 2, 6, 5], [7, 7], [5, 8, 1, 2, 6]]
    n = 30
    conts = [r.token_ids for r in generate(target, prompts, max_new_tokens=n + 3)]
    oracle = OracleDeviceDrafter(target.vocab_size, 2, ["none", "chain:3"], target.device)
    for p, c in list(zip(prompts, conts))[:registered]:
        oracle.set_continuation(p, c)
    engine = Engine(target, oracle, ["none", "chain:3"], max_batch=4, max_seqlen=64, goodput=True)
    _fixed_costs(engine, {"none": 1e-3, "chain:3": 2e-3})
    reqs = engine.run([Request(p, max_new_tokens=n) for p in prompts])
    assert [r.output for r in reqs] == [c[:n] for c in conts]
    if registered == 4:
        assert engine.metrics["drain_plain_steps"] == 0 and engine.metrics["steps:chain:3"] >= 8
    else:
        assert engine.metrics["drain_plain_steps"] >= 5


def test_a_new_batch_starts_from_how_slow_the_slowest_sequence_was_before(models):
    """The same draining batch twice on one engine (one sequence's continuation unknown): the first run drafts
    until that sequence's own steps show it slow; the second starts from the finished sequences' ratios and
    turns to plain steps sooner. Output stays plain greedy in both."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.verifier.decode.engine import Engine, Request

    target = models["hybrid"]
    prompts = [[3, 1, 4], [9, 2, 6, 5], [7, 7], [5, 8, 1, 2, 6]]
    n = 30
    conts = [r.token_ids for r in generate(target, prompts, max_new_tokens=n + 3)]
    oracle = OracleDeviceDrafter(target.vocab_size, 2, ["none", "chain:3"], target.device)
    for p, c in list(zip(prompts, conts))[:3]:
        oracle.set_continuation(p, c)
    engine = Engine(target, oracle, ["none", "chain:3"], max_batch=4, max_seqlen=64, goodput=True)
    _fixed_costs(engine, {"none": 1e-3, "chain:3": 2e-3})
    engine.chooser.slow_prior.min_history = 4  # the first run's four sequences
    drafted = []
    for _ in range(2):
        before = engine.metrics["steps:chain:3"]
        reqs = engine.run([Request(p, max_new_tokens=n) for p in prompts])
        assert [r.output for r in reqs] == [c[:n] for c in conts]
        drafted.append(engine.metrics["steps:chain:3"] - before)
    assert len(engine.chooser.slow_prior.ratios) >= 3 and engine.chooser.slow_prior.ratio(4) < 0.6
    assert drafted[1] < drafted[0]
