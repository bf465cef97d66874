"""The oracle drafter: trees are valid, within budget, and verification accepts exactly k tokens plus the bonus."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.drafter_service.drafters.oracle import OracleDrafter
from stree.protocols.drafter import DraftBudget
from stree.protocols.sampling import SamplingParams
from stree.verifier.decode.loop import generate

PROMPT = [3, 1, 4]


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 6), extra=st.integers(0, 30), width=st.integers(1, 5), seed=st.integers(0, 99))
def test_tree_holds_the_right_chain_then_only_wrong_tokens(k, extra, width, seed):
    cont = [(7 * i + 2) % 50 for i in range(40)]
    nodes = k + 2 + extra
    budget = DraftBudget(max_nodes=64, max_depth=10, max_width=width)
    session = OracleDrafter(PROMPT, cont, 50, k, nodes, seed).open(PROMPT, SamplingParams())
    tree = session.draft(budget)
    assert budget.violation(tree) is None
    assert tree.num_nodes <= nodes
    # walking the known continuation from the root matches exactly k levels
    node, depth = 0, 0
    kids = tree.children()
    while True:
        nxt = [c for c in kids[node] if int(tree.tokens[c]) == cont[depth]]
        assert len(nxt) <= 1
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    assert depth == k


def test_greedy_generation_accepts_tau_and_equals_plain(models):
    target = models["hybrid"]
    cont = generate(target, PROMPT, max_new_tokens=40).token_ids
    for k, nodes in ((1, 3), (3, 12), (5, 20)):
        res = generate(target, PROMPT, drafter=OracleDrafter(PROMPT, cont, target.vocab_size, k, nodes),
                       max_new_tokens=30)
        assert res.token_ids == cont[:30]
        # every step accepts k + 1 tokens, but the last may be cut short by max_new_tokens
        assert res.stats["steps"] == -(-30 // (k + 1))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="cannot hold a chain"):
        OracleDrafter(PROMPT, [1, 2], 50, 3, nodes=4)
    with pytest.raises(ValueError, match="other than the one"):
        OracleDrafter(PROMPT, [1, 2], 50, 1).open([9], SamplingParams())


def test_refresh_recovers_from_a_wrong_continuation(models):
    from stree.bench.oracle import greedy_refresher

    target = models["hybrid"]
    cont = generate(target, PROMPT, max_new_tokens=40).token_ids
    wrong = cont[:10] + [(t + 1) % target.vocab_size for t in cont[10:]]
    drafter = OracleDrafter(PROMPT, wrong, target.vocab_size, 3, 8, refresh=greedy_refresher(target, 16, 128))
    res = generate(target, PROMPT, drafter=drafter, max_new_tokens=36)
    assert res.token_ids == cont[:36]
    assert drafter.refreshes >= 1 and drafter.refresh_s > 0
    assert res.stats["mean_accepted_length"] > 3.0  # back on track after the refresh


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@pytest.mark.parametrize("k, shape", [(0, "chain:1"), (2, "chain:3"), (2, "static:2,2,1"), (1, "static:3,1")])
def test_device_oracle_in_the_batched_engine_accepts_exactly_tau(models, arch, k, shape):
    """Batch of prompts of different lengths: output equals plain greedy, and every step of a registered prompt
    accepts k + 1 tokens."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter

    target = models[arch]
    prompts = [[3, 1, 4], [9, 2, 6, 5, 3, 5], [7]]
    n = 12
    conts = [r.token_ids for r in generate(target, prompts, max_new_tokens=n + k + 1)]
    oracle = OracleDeviceDrafter(target.vocab_size, k, shape, target.device)
    for p, c in zip(prompts[:2], conts):
        oracle.set_continuation(p, c)
    outs = generate(target, prompts, drafter=oracle, max_new_tokens=n, max_batch=3)
    assert [o.token_ids for o in outs] == [c[:n] for c in conts]
    assert [o.stats["steps"] for o in outs[:2]] == [-(-n // (k + 1))] * 2
    # the third prompt has no continuation registered: arbitrary drafts, and the output is still exact


def test_device_oracle_with_auto_choice_equals_plain(models):
    """Over none, a chain and a tree the engine picks by goodput; the output stays plain greedy."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter

    target = models["hybrid"]
    prompts = [[3, 1, 4], [9, 2, 6, 5]]
    conts = [r.token_ids for r in generate(target, prompts, max_new_tokens=24)]
    oracle = OracleDeviceDrafter(target.vocab_size, 2, ["none", "chain:3", "static:2,2,1"], target.device)
    for p, c in zip(prompts, conts):
        oracle.set_continuation(p, c)
    outs = generate(target, prompts, drafter=oracle, max_new_tokens=20)
    assert [o.token_ids for o in outs] == [c[:20] for c in conts]


def test_device_oracle_refuses_what_it_cannot_lay_out():
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter

    with pytest.raises(ValueError, match="must be chain or static"):
        OracleDeviceDrafter(50, 1, "beam:3x2", "cpu")
    with pytest.raises(ValueError, match="correct_depth 3"):
        OracleDeviceDrafter(50, 3, "chain:3", "cpu")
    with pytest.raises(ValueError, match="no continuation registered"):
        OracleDeviceDrafter(50, 1, "chain:2", "cpu").open([1, 2], SamplingParams())


def test_device_oracle_replays_recorded_acceptance_by_depth():
    """With ``accept_rates`` each row's right levels are drawn per draft: P(k >= d) follows the rates (a binomial
    check at 5 sigma over 20000 rows, which a fixed k or shifted rates fail), and the layout puts right tokens on
    exactly the first k levels of each row."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.protocols.sampling import RowSampling

    rates = [0.9, 0.6, 0.35]
    oracle = OracleDeviceDrafter(50, 3, "chain:4", "cpu", accept_rates=rates)
    rows = 20000
    sampling = RowSampling.greedy(rows, "cpu")
    sampling.seed.copy_(torch.arange(rows) * 7919 + 3)  # rows of 20000 requests, each with its own seed
    k = oracle.right_levels(sampling)[:, 0]
    for d, rate in enumerate(rates, start=1):
        seen = float((k >= d).float().mean())
        assert abs(seen - rate) < 5 * (rate * (1 - rate) / rows) ** 0.5, (d, seen, rate)
    oracle.new_slots(4, 16)
    cont = list(range(10, 26))
    for slot in range(4):
        oracle.seq[slot, : len(cont)] = torch.tensor(cont)
    draft = oracle.draft(oracle.shapes[0], torch.tensor([9] * 4), RowSampling.greedy(4, "cpu"), False)
    for row in draft.tokens.tolist():
        right = next((d for d in range(1, 4) if row[d] != cont[d]), 4) - 1
        assert row[1: right + 1] == cont[1: right + 1] and all(t != c for t, c in zip(row[right + 1:], cont[right + 1:]))


def test_device_oracle_refuses_bad_acceptance_rates():
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter

    for bad in ([0.5, 0.7], [1.2], [], [0.9, 0.8, 0.7, 0.6]):
        with pytest.raises(ValueError, match="accept_rates"):
            OracleDeviceDrafter(50, 3, "chain:4", "cpu", accept_rates=bad)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@pytest.mark.parametrize("k, shape", [(2, "chain:3"), (1, "static:2,2,1")])
def test_self_oracle_output_is_a_continuation_the_device_oracle_follows_at_exactly_tau(models, arch, k, shape):
    """The target drafting for itself is lossless and accepts k + 1 per step; an oracle holding its output
    accepts k + 1 per step on the same shape and batch."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.drafter_service.drafters.oracle_self import SelfOracleDrafter

    target = models[arch]
    prompts = [[3, 1, 4], [9, 2, 6, 5, 3, 5]]
    n, tau = 12, k + 1
    plain = [r.token_ids for r in generate(target, prompts, max_new_tokens=n + tau)]
    made = generate(target, prompts, drafter=SelfOracleDrafter(target, shape, k), max_new_tokens=n + tau, max_batch=2)
    assert [o.token_ids for o in made] == plain
    assert [o.stats["steps"] for o in made] == [-(-(n + tau) // tau)] * 2
    oracle = OracleDeviceDrafter(target.vocab_size, k, shape, target.device)
    for p, o in zip(prompts, made):
        oracle.set_continuation(p, o.token_ids)
    outs = generate(target, prompts, drafter=oracle, max_new_tokens=n, max_batch=2)
    assert [o.token_ids for o in outs] == [c[:n] for c in plain]
    assert [o.stats["steps"] for o in outs] == [-(-n // tau)] * 2


def test_self_oracle_refuses_what_it_cannot_do(models):
    import torch

    from stree.drafter_service.drafters.oracle_self import SelfOracleDrafter
    from stree.protocols.sampling import RowSampling, SamplingParams

    target = models["mamba2"]
    with pytest.raises(ValueError, match="chain or static"):
        SelfOracleDrafter(target, "beam:3x2", 1)
    with pytest.raises(ValueError, match="correct_depth 3"):
        SelfOracleDrafter(target, "chain:3", 3)
    drafter = SelfOracleDrafter(target, "chain:3", 1)
    drafter.new_slots(1, 16)
    with pytest.raises(ValueError, match="greedy"):
        sampling = RowSampling.greedy(1, target.device)
        sampling.set_row(0, SamplingParams(temperature=1.0))
        drafter.draft(drafter.tree, torch.tensor([3]), sampling, any_sampled=True)


def test_a_drafter_never_deferred_is_charged_no_refresh_and_auto_leaves_plain_early(models):
    """The oracle follows every step (not lazy), so leaving plain decoding refreshes nothing. With step costs known
    (as graph captures give them on the GPU) and a 2 % exploration budget, a first look at a free chain right to depth
    2 must come within a short run; charged a phantom refresh the size of an admission, it would come only after
    hundreds of plain steps, so a 128-token run would stay plain."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.protocols.tree_shape import TreeShape
    from stree.verifier.decode.engine import Engine, Request

    target = models["hybrid"]
    prompt, n = [3, 1, 4], 40
    cont = generate(target, prompt, max_new_tokens=n + 3).token_ids
    oracle = OracleDeviceDrafter(target.vocab_size, 2, ["none", "chain:3"], target.device)
    oracle.set_continuation(prompt, cont)
    engine = Engine(target, oracle, ["none", "chain:3"], max_batch=1, max_seqlen=64, goodput=True)
    assert not engine.drafter.defer
    for shape in ("none", "chain:3"):  # the same cost for both: a look at the chain can lose nothing but a refresh
        engine.goodput.prime(TreeShape.parse(shape), False, cost=1e-4)
    [req] = engine.run([Request(prompt, max_new_tokens=n)])
    assert req.output == cont[:n]
    mode = engine.goodput.mode(False)
    assert mode.refresh_cost == 0.0 and engine.metrics["drafter_refreshes"] == 0
    assert mode.stats[TreeShape.parse("chain:3")].seen >= mode.min_samples
