"""A draining batch: draft only while that finishes the running set sooner (verifier/decode/drain.py), exactly."""

from __future__ import annotations

import pytest

from stree.verifier.decode.drain import draft_finishes_later, sequence_taus
from stree.verifier.decode.loop import generate


def test_each_sequence_gets_the_drafts_gain_scaled_by_its_own_acceptance_shrunk_to_the_mean():
    # batch mean 1 accepted per step; the second sequence accepted nothing in 12 steps, the third never drafted
    taus = sequence_taus(3.0, [12, 0, 0], [12, 12, 0], prior_steps=4.0)
    assert taus[0] == pytest.approx(1 + 2 * (12 + 4 * 0.5) / 16 / 0.5)
    assert taus[1] == pytest.approx(1 + 2 * (4 * 0.5 / 16) / 0.5)  # a quarter of the gain: 4 prior steps of 16
    assert taus[2] == pytest.approx(3.0)  # no steps of its own: the batch's
    assert sequence_taus(2.5, [0, 0], [0, 0]) == [2.5, 2.5]
    assert sequence_taus(2.5, [0, 0], [3, 3]) == [1.0, 1.0]  # nothing ever accepted: no gain


def test_the_slowest_sequence_decides_when_the_batch_drains():
    # the pair at batch 64 (H100, §0r): chain:3 at 2.08x plain's cost; the batch mean tau 2.31 would win ...
    assert not draft_finishes_later([128] * 4, [2.31] * 4, 1.734, 0.833)
    # ... but a sequence that gets only half the draft's gain finishes last, later than plain decoding would
    assert draft_finishes_later([128] * 4, [2.31, 2.31, 2.31, 1.655], 1.734, 0.833)
    # near the end the longest remaining run decides: plain needs 5 more steps, the draft 2
    assert not draft_finishes_later([5, 1, 1], [3.0, 1.0, 1.0], 2.0, 1.0)
    assert not draft_finishes_later([], [], 2.0, 1.0)


def _fixed_costs(engine, cost: dict) -> None:
    """Make goodput control see fixed step costs (wall time on the CPU would make the test depend on the machine)."""
    observe = engine.goodput.observe

    def fixed(shape, tau, seconds, refresh_s=0.0, sampled=False, emitted=None):
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
