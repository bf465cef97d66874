"""Goodput control: the best measured shape wins; losing retries back off, winning ones reset."""

from __future__ import annotations

import pytest
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.goodput import GoodputController


def _run(ctl: GoodputController, steps: int, cost: dict, tau: dict) -> list[str]:
    chosen = []
    for _ in range(steps):
        s = ctl.choose()
        chosen.append(str(s))
        ctl.observe(s, tau[str(s)], cost[str(s)])
    return chosen


def test_losing_retries_back_off_and_a_winning_one_resets():
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=8, max_retry_every=32, min_samples=1)
    cost, tau = {"none": 1.0, "chain:3": 4.0}, {"none": 1.0, "chain:3": 2.0}  # chain: 0.5 tok/s vs 1
    chosen = _run(ctl, 200, cost, tau)
    retries = [i for i, s in enumerate(chosen) if s == "chain:3"]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps[:3] == [9, 17, 33] and set(gaps[3:]) == {33}  # 8 -> 16 -> 32, capped at 32
    assert ctl.stats[chain].retry_every == 32
    cost["chain:3"] = 1.0  # the drafter got cheap: its next retry wins and resets the interval
    chosen = _run(ctl, 120, cost, tau)
    assert ctl.stats[chain].retry_every == 8 and chosen[-30:].count("chain:3") >= 27
    assert ctl.stats[plain].retry_every > 8  # now plain decoding is the one that keeps losing its retries


def test_every_shape_is_measured_before_the_numbers_are_trusted():
    shapes = [TreeShape.parse(s) for s in ("none", "chain:1", "static:2,1")]
    ctl = GoodputController(shapes, min_samples=3)
    first = [str(ctl.choose()) for _ in range(3)]
    assert first == ["none", "none", "none"]  # nothing observed yet: the first unmeasured shape again
    for s in shapes:
        for tau in (0.5, 1.0 + s.max_depth, 1.5 + 2 * s.max_depth):  # mean: 1 + s.max_depth
            assert ctl.choose() == s  # each shape is measured min_samples times in turn
            ctl.observe(s, tau, 1.0)
        assert ctl.stats[s].tau == 1.0 + s.max_depth
    assert str(ctl.choose()) == "static:2,1"  # 3 tokens per second against 2 and 1


def test_a_shape_within_the_hysteresis_does_not_take_over():
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=10_000, hysteresis=0.05, min_samples=1)
    ctl.observe(plain, 1.0, 1.0)
    ctl.observe(chain, 1.03, 1.0)
    assert ctl.choose() == chain  # nothing current yet: the best
    ctl.stats[plain].tau = 1.07  # plain now 4 % faster: within the hysteresis, chain stays
    assert [ctl.choose() for _ in range(5)] == [chain] * 5
    ctl.stats[plain].tau = 1.09  # 6 % faster: plain takes over
    assert ctl.choose() == plain and ctl.current == plain


def test_retries_due_about_together_run_in_one_burst():
    """Shapes half-way to their retry are retried right after the one that is due: one drafter refresh."""
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2", "chain:4")]
    ctl = GoodputController(shapes, retry_every=20, min_samples=1)
    cost, tau = {"none": 1.0, "chain:2": 4.0, "chain:4": 4.0}, {"none": 1.0, "chain:2": 2.0, "chain:4": 2.0}
    chosen = _run(ctl, 80, cost, tau)
    retried = [i for i, x in enumerate(chosen) if x != "none"]
    runs = [b - a for a, b in zip(retried, retried[1:])]
    assert retried[:2] == [1, 2] and runs.count(1) == len(retried) // 2  # chain:2 then chain:4, every time


def test_a_refresh_is_charged_in_part_so_a_draft_that_wins_per_step_takes_over():
    """A draft 1.5x faster per step whose first step refreshed the drafter (20x a step) still takes over:
    the refresh is charged 1/refresh_steps; charged whole, that first sample would bury it."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=10_000, refresh_steps=32, min_samples=1)
    ctl.observe(plain, 1.0, 1.0)
    ctl.observe(chain, 3.0, 2.0, refresh_s=20.0)
    assert ctl.stats[chain].cost == 2.0 + 20.0 / 32 and ctl.choose() == chain
    whole = GoodputController([plain, chain], retry_every=10_000, refresh_steps=1, min_samples=1)
    whole.observe(plain, 1.0, 1.0)
    whole.observe(chain, 3.0, 2.0, refresh_s=20.0)
    assert whole.choose() == plain


def test_a_retry_runs_min_samples_steps_whose_mean_outweighs_the_old_estimate():
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=6, min_samples=2)
    cost, tau = {"none": 1.0, "chain:3": 1.0}, {"none": 1.0, "chain:3": 0.5}  # chain loses
    chosen = _run(ctl, 12, cost, tau)
    assert chosen[:4] == ["none", "none", "chain:3", "chain:3"]  # explored min_samples times each
    first_retry = chosen.index("chain:3", 4)
    assert chosen[first_retry: first_retry + 2] == ["chain:3", "chain:3"]  # a retry is min_samples steps
    before = ctl.stats[chain].tau
    ctl.stats[chain].tau = 0.5
    tau["chain:3"] = 3.5  # the drafter got good: a retry's two samples (3.5, 3.5) and the old 0.5 -> 2.5
    while not ctl.stats[chain].retrying:  # plain steps until the retry starts (its first sample observed)
        s = ctl.choose()
        ctl.observe(s, tau[str(s)], cost[str(s)])
    assert ctl.stats[chain].retry_seen == 1 and ctl.choose() == chain
    ctl.observe(chain, 3.5, 1.0)
    assert not ctl.stats[chain].retrying and abs(ctl.stats[chain].tau - 2.5) < 1e-9 and before == 0.5


def test_greedy_and_sampled_steps_keep_separate_statistics():
    """A draft that pays for greedy rows and not for sampled ones: each mode settles on its own best shape, and
    the sampled mode's samples never move the greedy mode's numbers."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=10_000, min_samples=2)
    tau = {False: {"none": 1.0, "chain:3": 3.0}, True: {"none": 1.0, "chain:3": 1.2}}
    cost = {"none": 1.0, "chain:3": 2.0}
    for sampled in (False, True, False, True):
        for _ in range(12):
            s = ctl.choose(sampled)
            ctl.observe(s, tau[sampled][str(s)], cost[str(s)], sampled=sampled)
    assert ctl.choose(False) == chain and ctl.choose(True) == plain
    assert ctl.stats[chain].tau == pytest.approx(3.0) and ctl.mode(True).stats[chain].tau == pytest.approx(1.2)
    rows = {(r["shape"], r["sampled"]): r for r in ctl.table()}
    assert set(rows) == {(s, m) for s in ("none", "chain:3") for m in (False, True)}


def test_an_explore_budget_bounds_the_time_retries_lose():
    """A draft 2x slower per token than plain decoding is retried less often with a budget, and its retries
    lose at most about the budget's fraction of the measured time; without it they lose more."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    cost, tau = {"none": 1.0, "chain:3": 4.0}, {"none": 1.0, "chain:3": 2.0}  # chain loses 2 s per step

    def lost_fraction(**kw):
        ctl = GoodputController([plain, chain], retry_every=8, max_retry_every=64, min_samples=2, **kw)
        chosen = _run(ctl, 4000, cost, tau)
        return 2.0 * chosen[40:].count("chain:3") / ctl.mode().clock

    with_budget, without = lost_fraction(explore_budget=0.02), lost_fraction()
    assert with_budget <= 0.022 and without > 2 * with_budget


def test_a_bad_explore_budget_is_refused():
    with pytest.raises(ValueError, match="explore_budget"):
        GoodputController([TreeShape.parse("none")], explore_budget=0.0)


def test_a_retry_from_plain_decoding_counts_its_drafter_refresh_in_the_budget():
    """Leaving plain decoding to retry a draft first refreshes the stale drafter: the retry's expected loss counts
    the refreshes' running mean, so the same draft is due later once refreshes were observed."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], retry_every=1, min_samples=2, explore_budget=0.1)
    cost, tau = {"none": 1.0, "chain:3": 3.0}, {"none": 1.0, "chain:3": 2.5}  # chain loses 0.5 s per step
    chooser = ctl.mode()
    for _ in range(8):  # both measured (2 steps each), then plain chosen on merit
        s = ctl.choose()
        ctl.observe(s, tau[str(s)], cost[str(s)])
        if chooser.current == plain:
            break
    assert chooser.current == plain
    while chooser.clock - chooser.stats[chain].last_clock < 11.0:  # plain steps, outside choose: no retry runs
        chooser.step += 1
        ctl.observe(plain, 1.0, 1.0)
    assert chooser.refresh_s == 0.0 and chooser._due(chain, plain)  # loss 2 x 0.5 = 1 s, 11 s since: 9 % < 10 %
    ctl.observe(plain, 1.0, 1.0, refresh_s=2.0)  # a refresh seen (its 1/32 share charged to that step)
    assert chooser.refresh_s == pytest.approx(2.0)
    assert not chooser._due(chain, plain)  # loss 1 + 2 s against 12 s: 25 % > 10 %
