"""Goodput control: the best measured shape wins; losing retries back off, winning ones reset."""

from __future__ import annotations

import pytest
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.goodput import GoodputController
from stree.verifier.decode.shape_chooser import ShapeChooser


def _due(chooser: ShapeChooser, shape: TreeShape, best: TreeShape) -> bool:
    """Whether ``shape``'s retry is due against the ``best`` shape's rate."""
    return chooser._due_row(chooser.stats[shape], chooser.rate(best))


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


def test_a_draft_within_the_hysteresis_does_not_take_over_but_plain_decoding_does():
    """The margin guards moves onto a draft (they may cost a drafter refresh); leaving a draft for plain decoding is
    free, so plain takes over as soon as it is faster."""
    plain, chain, deeper = TreeShape.parse("none"), TreeShape.parse("chain:3"), TreeShape.parse("chain:4")
    ctl = GoodputController([plain, chain, deeper], retry_every=10_000, hysteresis=0.05, min_samples=1)
    ctl.observe(plain, 1.0, 1.0)
    ctl.observe(chain, 1.03, 1.0)
    ctl.observe(deeper, 0.5, 1.0)
    assert ctl.choose() == chain  # nothing current yet: the best
    ctl.stats[deeper].tau = 1.07  # another draft 4 % faster: within the hysteresis, chain stays
    assert [ctl.choose() for _ in range(5)] == [chain] * 5
    ctl.stats[deeper].tau = 1.09  # 6 % faster: it takes over
    assert ctl.choose() == deeper
    ctl.stats[plain].tau = 1.10  # plain 1 % faster than the current draft: plain at once
    assert ctl.choose() == plain and ctl.current == plain
    ctl.stats[chain].tau = 1.14  # a draft 3.6 % faster than plain: within the hysteresis, plain stays
    assert [ctl.choose() for _ in range(5)] == [plain] * 5
    ctl.stats[chain].tau = 1.17  # 6 % faster: it takes over
    assert ctl.choose() == chain


def test_retries_due_about_together_run_in_one_burst():
    """Shapes half-way to their retry are retried right after the one that is due: one drafter refresh."""
    shapes = [TreeShape.parse(x) for x in ("none", "static:2,1", "beam:2x2")]
    ctl = GoodputController(shapes, retry_every=20, min_samples=1)
    cost, tau = {"none": 1.0, "static:2,1": 4.0, "beam:2x2": 4.0}, {"none": 1.0, "static:2,1": 2.0, "beam:2x2": 2.0}
    chosen = _run(ctl, 80, cost, tau)
    retried = [i for i, x in enumerate(chosen) if x != "none"]
    runs = [b - a for a, b in zip(retried, retried[1:])]
    assert retried[:2] == [1, 2] and runs.count(1) == len(retried) // 2  # static then beam, every time


def test_a_chain_s_retry_runs_the_deepest_chain():
    """Per-depth acceptance: the deepest chain's steps measure every shorter chain, so a due chain is retried as the
    deepest one (one burst, one refresh), and the shorter chains' retry clocks restart with it. A retry that loses
    backs off every chain it measured: one shared interval, doubling."""
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2", "chain:4")]
    ctl = GoodputController(shapes, retry_every=20, max_retry_every=1000, min_samples=1)
    cost = {"none": 1.0, "chain:2": 4.0, "chain:4": 4.5}
    emitted = {"none": [1], "chain:2": [2, 1], "chain:4": [2, 1]}  # one drafted token accepted in two: both lose
    chosen = []
    for _ in range(400):
        s = ctl.choose()
        chosen.append(str(s))
        ctl.observe(s, sum(emitted[str(s)]) / 2, cost[str(s)], emitted=emitted[str(s)])
    assert chosen[:3] == ["none", "chain:2", "chain:4"]  # measured first (no known costs), each once
    assert "chain:2" not in chosen[3:]  # retries: only the deepest chain
    retries = [i for i, x in enumerate(chosen) if x == "chain:4"]
    assert [b - a for a, b in zip(retries, retries[1:])] == [21, 41, 81, 161]  # 20 -> 40 -> 80 -> 160, shared
    assert ctl.stats[shapes[1]].retry_every == ctl.stats[shapes[2]].retry_every == 320
    assert ctl.stats[shapes[1]].pooled and ctl.stats[shapes[1]].tau == pytest.approx(1.5)


def test_a_short_chain_s_retry_is_priced_as_the_deepest_chain_it_runs():
    """With a budget, a due chain:1 is retried only when the loss of what its retry runs (chain:4, four times the
    cost) fits, not chain:1's own."""
    plain, chain1, chain4 = (TreeShape.parse(x) for x in ("none", "chain:1", "chain:4"))
    chooser = ShapeChooser([plain, chain1, chain4], retry_every=1, min_samples=1, explore_budget=0.02)
    chooser.observe(plain, 1.0, 1.0)
    chooser.observe(chain1, 1.5, 1.6, emitted=[2, 1])  # chain:1 loses 0.1 s a step, chain:4 1.5 s
    chooser.observe(chain4, 2.0, 3.5, emitted=[2, 2])
    chooser.current = plain
    while chooser.budget.clock - chooser.stats[chain1].last_clock < 10.0:  # 10 s of plain: room for 0.2 s of loss
        chooser.step += 1
        chooser.observe(plain, 1.0, 1.0)
    assert chooser._retried_row(chooser.stats[chain1]).shape == chain4
    assert not _due(chooser, chain1, plain)  # chain:4's loss, 1.5 s, is over 2 % of 10 s (chain:1's 0.1 s is not)


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
    assert ctl.stats[chain].retry_samples == 1 and ctl.choose() == chain
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
        return 2.0 * chosen[40:].count("chain:3") / ctl.mode().budget.clock

    with_budget, without = lost_fraction(explore_budget=0.02), lost_fraction()
    assert with_budget <= 0.022 and without > 2 * with_budget


def test_a_bad_explore_budget_is_refused():
    with pytest.raises(ValueError, match="explore_budget"):
        GoodputController([TreeShape.parse("none")], explore_budget=0.0)


def _settled_on_plain():
    """A controller over plain decoding and chain:3 (which loses 0.5 s a step), both measured and plain chosen on
    merit, with a 10 % budget; returns it, its greedy chooser and the two shapes."""
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
    return ctl, chooser, plain, chain


def _plain_steps_until(ctl, chooser, plain, chain, since: float) -> None:
    """Plain steps, outside ``choose`` (so no retry runs), until ``since`` seconds passed since chain:3 last ran."""
    while chooser.budget.clock - chooser.stats[chain].last_clock < since:
        chooser.step += 1
        ctl.observe(plain, 1.0, 1.0)


def test_a_retry_from_plain_decoding_counts_its_drafter_refresh_in_the_budget():
    """Leaving plain decoding to retry a draft first refreshes the stale drafter: the retry's expected loss counts
    the refreshes' running mean, so the same draft is due later once refreshes were observed."""
    ctl, chooser, plain, chain = _settled_on_plain()
    _plain_steps_until(ctl, chooser, plain, chain, 11.0)
    assert chooser.refresh_s == 0.0 and _due(chooser, chain, plain)  # loss 2 x 0.5 = 1 s, 11 s since: 9 % < 10 %
    ctl.observe(plain, 1.0, 1.0, refresh_s=2.0)  # a refresh seen (its 1/32 share charged to that step)
    assert chooser.refresh_s == pytest.approx(2.0)
    assert not _due(chooser, chain, plain)  # loss 1 + 2 s against 12 s: 25 % > 10 %


def test_a_retry_from_plain_decoding_pays_one_refresh_per_running_sequence():
    """A measured refresh counts per sequence it prefilled, and a retry from plain decoding is priced with one per
    sequence of the step: due at batch 1, not at batch 8 (a retry priced with one sequence's refresh would refresh
    all 16 or 64 running sequences and lose several % of a run)."""
    ctl, chooser, plain, chain = _settled_on_plain()
    ctl.observe(plain, 1.0, 1.0, refresh_s=4.0, refreshed=8)  # eight sequences refreshed in 4 s
    assert chooser.refresh_cost == pytest.approx(0.5)
    _plain_steps_until(ctl, chooser, plain, chain, 16.0)
    chooser.rows = 1
    assert _due(chooser, chain, plain)  # loss 2 steps x 0.5 + 0.5 = 1.5 s against 16 s since: within 10 %
    chooser.rows = 8  # one step of eight sequences (min_samples 2), but eight refreshes: 0.5 + 8 x 0.5 = 4.5 s
    assert chooser.burst_steps() == 1 and not _due(chooser, chain, plain)


def test_a_windowed_budget_is_not_banked_through_a_quiet_stretch():
    """With ``explore_window`` the budget is a fraction of about the last N steps' time: a long stretch of plain steps
    does not save up room for a retry that loses more than that (counted over the whole run it would)."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    whole, windowed = (ShapeChooser([plain, chain], retry_every=1, min_samples=1, explore_budget=0.02,
                                    explore_window=window) for window in (None, 20))
    for chooser in (whole, windowed):
        chooser.observe(chain, 2.5, 3.0)  # chain: 0.83 tokens a second against plain's 1 (1.08 at tau 3.25)
        chooser.observe(plain, 1.0, 1.0)
        chooser.current = plain
        for _ in range(10_000):  # 10,000 s of plain steps, no retry asked for
            chooser.step += 1
            chooser.observe(plain, 1.0, 1.0)
    # the retry loses 3 - 2.5 = 0.5 s (min_samples 1): within 2 % of 10,000 s, not of the ~20 s the window holds
    assert _due(whole, chain, plain) and not _due(windowed, chain, plain)
    assert windowed.budget.recent == pytest.approx(20.0, rel=1e-3) and windowed.budget.clock == whole.budget.clock
    with pytest.raises(ValueError, match="explore_window"):
        ShapeChooser([plain], explore_window=0)


def test_with_a_budget_a_draft_that_could_not_win_is_not_retried():
    """A retry only re-measures acceptance: with a budget, a draft that would not beat plain decoding by the hysteresis
    even with its acceptance halfway to its ceiling is never retried, however long the run; one that would is."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    for tau, retried in ((2.0, False), (2.5, True)):  # at cost 3: 3.0 / 3 = 1.0 tokens a second, 3.25 / 3 = 1.08
        chooser = ShapeChooser([plain, chain], retry_every=8, min_samples=1, explore_budget=0.1)
        chooser.observe(plain, 1.0, 1.0)
        chooser.observe(chain, tau, 3.0)
        chosen = []
        for _ in range(2000):
            s = chooser.choose()
            chosen.append(s)
            chooser.observe(s, 1.0 if s == plain else tau, 1.0 if s == plain else 3.0)
        assert (chain in chosen) == retried


def test_a_tree_is_first_looked_at_only_if_it_could_win_at_the_acceptance_of_its_depth_s_chain():
    """With known costs and measured chains, a beam of depth 2 is looked at only if it beats plain decoding by the
    hysteresis with acceptance halfway from chain:2's to its ceiling: not at chain:2 tau 1.5, at 1.9 it is."""
    plain, chain, beam = (TreeShape.parse(x) for x in ("none", "chain:2", "beam:2x2"))
    cost = {"none": 1.0, "chain:2": 2.0, "beam:2x2": 2.2}  # beam's ceiling: 3 tokens for 2.2 s, 1.36 a second
    for emitted, looked in (([2, 1], False), ([3, 3, 3, 2, 2, 2, 1, 1, 1, 1], True)):  # chain:2 tau 1.5 / 1.9
        chooser = _primed([plain, chain, beam], cost, budget=0.5, min_samples=2, retry_every=10**6).mode()
        for _ in range(4):
            chooser.observe(chain, sum(emitted) / len(emitted), 2.0, emitted=emitted)
        for _ in range(100):
            chooser.observe(plain, 1.0, 1.0)
        chooser.current = plain
        # halfway to the ceiling: (1.5 + 0.75) / 2.2 = 1.02 a second, (1.9 + 0.55) / 2.2 = 1.11
        assert chooser.depths.tau(2) == pytest.approx(sum(emitted) / len(emitted))
        assert (chooser._first_look([chooser.stats[plain], chooser.stats[chain]]) == beam) == looked


def test_a_move_from_plain_decoding_onto_a_draft_pays_its_refresh():
    """Leaving plain decoding on merit refreshes every running sequence's drafter: the move prices that refresh as
    its ``refresh_steps`` steps share it, so a draft 8 % faster per step moves at batch 1 and not at batch 8."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:1")
    for rows, expected in ((1, chain), (8, plain)):
        chooser = ShapeChooser([plain, chain], retry_every=10**6, min_samples=1, hysteresis=0.05, refresh_steps=32)
        chooser.observe(plain, 1.0, 1.0)
        chooser.observe(chain, 1.08, 1.0)
        chooser.refresh_s = 0.5  # per sequence: 0.5 / 32 a step at batch 1 (1.6 %), 8 x that at batch 8 (12.5 %)
        chooser.current = plain
        assert chooser.choose(rows) == expected
    chooser.current = chain  # leaving a draft for plain decoding, or staying on it, pays no refresh
    assert chooser.choose(8) == chain


def _primed(shapes, costs: dict, budget=0.02, **kw) -> GoodputController:
    ctl = GoodputController(shapes, explore_budget=budget, **kw)
    for s in shapes:
        ctl.prime(s, False, cost=costs[str(s)])
    return ctl


def test_with_known_costs_a_shape_that_cannot_win_is_never_looked_at():
    """Costs timed at capture: a draft whose step costs more than (depth + 1) plain steps loses even if every
    drafted token were accepted, so it is never explored; plain decoding (tau exactly 1) runs from the start."""
    plain, chain, beam = (TreeShape.parse(x) for x in ("none", "chain:2", "beam:4x3"))
    cost = {"none": 1.0, "chain:2": 3.5, "beam:4x3": 5.5}  # both lose even at tau = depth + 1 (3 and 5)
    ctl = _primed([plain, chain, beam], cost)
    assert ctl.mode().measured(plain) and not ctl.mode().measured(chain)
    chosen = _run(ctl, 5000, cost, {"none": 1.0, "chain:2": 3.0, "beam:4x3": 5.0})
    assert set(chosen) == {"none"}


def test_first_looks_wait_for_the_budget_to_cover_their_loss_if_nothing_were_accepted():
    """A draft that could win is looked at only once the worst case (tau 1 for min_samples steps) fits the budget
    with every earlier first look: never at the start of a run. Of the chains that could win the deepest goes first
    (its steps would measure the shorter ones too): the shorter waits for it."""
    plain, chain2, chain4 = (TreeShape.parse(x) for x in ("none", "chain:2", "chain:4"))
    cost = {"none": 1.0, "chain:2": 2.0, "chain:4": 3.0}
    tau = {"none": 1.0, "chain:2": 2.8, "chain:4": 4.5}  # tokens per second: 1, 1.4, 1.5
    ctl = _primed([plain, chain2, chain4], cost, budget=0.02, min_samples=4, retry_every=10**6)
    chosen = _run(ctl, 1000, cost, tau)
    # chain:4's worst-case loss against plain decoding: 4 x (3 - 1) = 8 s, which needs 400 s of clock; chain:2's
    # (4 s, 200 s) would fit first, but it waits for chain:4, after which it could not win (3 / 2 s <= 1.5)
    first4 = chosen.index("chain:4")
    assert first4 == 400 and chosen[first4: first4 + 4] == ["chain:4"] * 4 and "chain:2" not in chosen
    assert chosen[-100:] == ["chain:4"] * 100  # then the best measured shape holds
    assert ctl.mode().budget.spent <= 0.02 * ctl.mode().budget.clock


def test_a_primed_tau_and_a_known_cost_choose_the_best_shape_without_exploring():
    """A new engine over the same drafter starts from its acceptance: with costs timed at capture, the first
    step already runs the best shape, and the others' first looks still wait for the budget."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = _primed([plain, chain], {"none": 1.0, "chain:3": 2.0}, min_samples=4)
    ctl.prime(chain, False, tau=3.0)
    assert ctl.mode().measured(chain) and ctl.choose() == chain
    ctl.prime(chain, True, tau=1.2)  # the sampled mode has its own numbers
    assert ctl.choose(True) == plain
    assert ctl.learned() == {(False, chain): (3.0, 256), (True, chain): (1.2, 256)}


def test_a_prime_never_overrides_a_shape_s_own_steps():
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    ctl = GoodputController([plain, chain], min_samples=1, explore_budget=0.02)
    ctl.observe(chain, 2.0, 1.5)
    ctl.prime(chain, False, tau=4.0, cost=0.1)
    r = ctl.stats[chain]
    assert (r.tau, r.cost, r.primed, r.known_cost) == (2.0, 1.5, False, False)
    ctl.prime(plain, False, tau=3.0, cost=1.0)  # plain's tau is exactly 1
    assert ctl.stats[plain].tau == 1.0 and ctl.stats[plain].known_cost


def test_one_explore_budget_bounds_the_retries_of_every_shape_together():
    """Three drafts, each 2 s per step slower than plain decoding: their retries together lose at most about the
    budget's fraction of the run (budgets per shape would add up to three times that)."""
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2", "chain:3", "chain:4")]
    cost = {"none": 1.0, "chain:2": 4.0, "chain:3": 4.0, "chain:4": 4.0}
    tau = {"none": 1.0, "chain:2": 2.0, "chain:3": 2.0, "chain:4": 2.0}
    ctl = GoodputController(shapes, retry_every=8, max_retry_every=64, min_samples=2, explore_budget=0.02)
    chosen = _run(ctl, 8000, cost, tau)
    lost = 2.0 * sum(1 for c in chosen[40:] if c != "none")
    assert lost / ctl.mode().budget.clock <= 0.022
    assert ctl.mode().budget.spent <= 0.02 * ctl.mode().budget.clock + 2 * 2.0  # at most one retry's overshoot


def test_before_a_refresh_is_measured_a_retry_from_plain_counts_the_guessed_one():
    """Until a drafter refresh has been measured, a retry from plain decoding counts the engine's guess (what an
    admission costs): the first retry must not be the one that finds out, at the run's expense, what a refresh of
    every running slot costs. A measured refresh replaces the guess."""
    ctl, chooser, plain, chain = _settled_on_plain()
    _plain_steps_until(ctl, chooser, plain, chain, 11.0)
    assert _due(chooser, chain, plain)  # loss 2 x 0.5 = 1 s against 11 s since: within 10 %
    ctl.guess_refresh(3.0)
    assert chooser.refresh_cost == 3.0 and not _due(chooser, chain, plain)  # 1 + 3 s: over 10 %
    assert ctl.mode(True).refresh_guess == 3.0  # a mode made later starts from the guess too
    ctl.observe(plain, 1.0, 1.0, refresh_s=0.2)
    assert chooser.refresh_cost == pytest.approx(0.2) and _due(chooser, chain, plain)


def _chain_emitted(rng, depth: int, p: list, batch: int) -> list[int]:
    """Tokens each of ``batch`` sequences emits in a chain:``depth`` step whose depth-d acceptance is ``p[d - 1]``."""
    out = []
    for _ in range(batch):
        n = 0
        while n < depth and rng.random() < p[n]:
            n += 1
        out.append(n + 1)
    return out


def test_a_deep_chain_s_steps_measure_every_shorter_chain_and_the_best_one_runs():
    """Per-depth acceptance (SmartSpec): only chain:4 is ever stepped, yet chain:1-3 become measured from its
    steps and the controller settles on the chain length with the best rate, which none of its steps ran."""
    import random

    rng = random.Random(7)
    shapes = [TreeShape.parse(x) for x in ("none", "chain:1", "chain:2", "chain:3", "chain:4")]
    cost = {"none": 1.0, "chain:1": 1.3, "chain:2": 1.6, "chain:3": 2.0, "chain:4": 2.6}
    p = [0.9, 0.8, 0.5, 0.5]  # tau: chain:1 1.9, chain:2 2.62, chain:3 2.98, chain:4 3.16
    true_rate = {s: (1 + sum(__import__("math").prod(p[:k]) for k in range(1, s.max_depth + 1))) / cost[str(s)]
                 for s in shapes}
    assert max(true_rate, key=true_rate.get) == shapes[2]  # chain:2, 1.64 tokens per second
    ctl = _primed(shapes, cost, budget=1.0, min_samples=4, retry_every=10**6)
    chooser = ctl.mode()
    for _ in range(4):  # chain:4's first look (forced): its steps report per-sequence emitted tokens
        chooser.step += 1
        emitted = _chain_emitted(rng, 4, p, batch=16)
        ctl.observe(shapes[4], sum(emitted) / 16, cost["chain:4"], emitted=emitted)
    for s in shapes[1:4]:
        r = ctl.stats[s]
        assert r.seen == 0 and r.pooled and chooser.measured(s)
        assert r.tau == pytest.approx(chooser.depths.tau(s.max_depth))
        assert r.tau == pytest.approx(true_rate[s] * cost[str(s)], rel=0.12)
    chosen = []
    for _ in range(400):
        s = ctl.choose()
        chosen.append(str(s))
        emitted = _chain_emitted(rng, s.max_depth, p, batch=16) if s.kind == "chain" else [1] * 16
        ctl.observe(s, sum(emitted) / 16, cost[str(s)], emitted=emitted)
    assert chosen[-100:].count("chain:2") >= 95
    assert ctl.stats[shapes[1]].seen == 0  # chain:1 never needed a step of its own
    assert ctl.stats[shapes[1]].tau == pytest.approx(1.9, abs=0.06)


def test_without_per_sequence_counts_chains_keep_their_own_means():
    """A caller that reports only the mean (as host-drafted steps do) leaves per-depth pooling out."""
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2", "chain:4")]
    ctl = GoodputController(shapes, min_samples=1)
    ctl.observe(shapes[2], 3.0, 1.0)
    assert not ctl.stats[shapes[1]].pooled and not ctl.mode().depths.rate
    ctl.observe(shapes[2], 3.0, 1.0, emitted=[3, 3])
    assert ctl.stats[shapes[1]].pooled and ctl.stats[shapes[1]].tau == pytest.approx(3.0)


def test_per_depth_acceptance_carries_over_to_a_new_controller():
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2", "chain:4")]
    old = GoodputController(shapes, min_samples=1)
    old.observe(shapes[2], 2.0, 1.0, emitted=[1, 3], sampled=True)
    new = GoodputController(shapes, min_samples=1)
    new.prime_depths(old.learned_depths())
    assert not new.mode(False).depths.rate  # greedy and sampled apart
    assert new.mode(True).depths.rate == old.mode(True).depths.rate
    assert new.mode(True).stats[shapes[1]].pooled and new.mode(True).stats[shapes[1]].seen == 0
    old.observe(shapes[2], 5.0, 1.0, emitted=[5, 5], sampled=True)  # a copy: the old one's steps stay its own
    assert new.mode(True).depths.rate != old.mode(True).depths.rate


def test_the_sampled_mode_follows_its_own_weight_of_the_newest_sample():
    shapes = [TreeShape.parse(x) for x in ("none", "chain:2")]
    ctl = GoodputController(shapes, sampled_alpha=0.25, min_samples=1)
    assert ctl.mode(False).alpha == 0.03 and ctl.mode(True).alpha == 0.25
    ctl.observe(shapes[1], 3.0, 1.0, sampled=True)
    ctl.observe(shapes[1], 1.0, 1.0, sampled=True)  # past min_samples: 3 + 0.25 x (1 - 3)
    assert ctl.mode(True).stats[shapes[1]].tau == pytest.approx(2.5)


def test_a_step_of_many_sequences_counts_as_that_many_samples():
    """min_samples counts sequence-steps: at batch 1 a first look is min_samples steps, at batch 2 half as many,
    at batch >= min_samples one; one step of 8 sequences measures a shape, and its retry is one step too."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:3")
    for rows, steps in ((1, 4), (2, 2), (3, 2), (8, 1)):
        ctl = GoodputController([plain, chain], retry_every=6, min_samples=4)
        chosen = []
        for _ in range(12):
            s = ctl.choose(rows=rows)
            chosen.append(str(s))
            ctl.observe(s, 2.0 if s == chain else 1.0, 1.0, emitted=[3 if s == chain else 1] * rows)
        assert chosen[:2 * steps] == ["none"] * steps + ["chain:3"] * steps, rows
        assert ctl.mode().measured(chain) and ctl.mode().stats[chain].seen >= steps


def test_at_batch_64_a_costly_draft_that_pays_is_looked_at_within_one_short_run():
    """Step costs of the 2.7B oracle at batch 64: plain 13.2 ms a step, chain:4 35 ms at tau 4. With a 2 % budget a
    first look priced at four chain steps would wait for 330 plain steps, longer than a 128-token run; priced at the
    one step that measures 64 sequences, it comes within ~90 steps, and then the chain is kept."""
    plain, chain = TreeShape.parse("none"), TreeShape.parse("chain:4")
    cost, tau = {"none": 13.2e-3, "chain:4": 35e-3}, {"none": 1.0, "chain:4": 4.0}

    def first_chain_step(rows: int) -> int | None:
        ctl = GoodputController([plain, chain], explore_budget=0.02)
        for s in (plain, chain):
            ctl.prime(s, False, cost=cost[str(s)])
        for step in range(400):
            s = ctl.choose(rows=rows)
            if s == chain:
                return step
            ctl.observe(s, tau[str(s)], cost[str(s)], emitted=[1] * rows)
        return None

    at_64 = first_chain_step(64)
    assert at_64 is not None and at_64 <= 100
    assert (first_chain_step(1) or 10**9) > 300  # one sequence: four steps to measure, a loss four times as large
