"""The batched engine: greedy output equals per-prompt plain greedy, token for token, at batch 1, 3, 8.

Every tree shape and drafter kind (device drafts: chain, static, beam; host drafters: n-gram),
pure Mamba2 and hybrid targets, prompts of different lengths, sequences that stop early (stop
token, small max_new_tokens) and sequences that join mid-run (more prompts than slots).
"""

from __future__ import annotations

import collections

import pytest
import torch

import stree
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.protocols import SamplingParams, create_drafter
from stree.verifier.decode.admission import AdmissionCosts, should_hold, steps_to_finish
from stree.verifier.decode.engine import Engine, Request


def _prompts(n: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(1, 14, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def _plain(model, prompt, n, stop=()):
    return stree.generate(model, prompt, drafter=None, max_new_tokens=n, stop_token_ids=stop,
                          cuda_graphs=False).token_ids


def _reference(model, prompt, n, stop=()):
    """Plain greedy by hand (prefill + argmax steps): the engine-independent truth."""
    state = model.new_state(1, len(prompt) + n + 2)
    if len(prompt) > 1:
        model.prefill(torch.tensor([prompt[:-1]]), state)
    out, tok = [], prompt[-1]
    for _ in range(n):
        tok = int(model.step(torch.tensor([tok]), state)[0].argmax())
        out.append(tok)
        if tok in stop:
            break
    return out


@pytest.mark.parametrize("target", ["mamba2", "hybrid"])
@pytest.mark.parametrize("shape", ["chain:3", "static:2,2,1", "beam:3x2"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_device_drafts_equal_plain_greedy(models, target, shape, batch):
    model, draft = models[target], models["draft"]
    gen = torch.Generator().manual_seed(batch * 7 + len(shape))
    prompts = _prompts(batch + 2, model.vocab_size, gen)  # more prompts than slots: some join mid-run
    limits = [5 + (i * 3) % 9 for i in range(len(prompts))]
    engine = Engine(model, DeviceTreeDrafter(draft), [shape], max_batch=batch, max_seqlen=64)
    reqs = engine.run([Request(p, max_new_tokens=m) for p, m in zip(prompts, limits)])
    for req, p, m in zip(reqs, prompts, limits):
        assert req.output == _reference(model, p, m), (shape, p)
        assert req.finish_reason == "length"
    assert engine.num_running == 0 and not engine.waiting


def test_stop_tokens_end_sequences_early(models):
    model, draft = models["hybrid"], models["draft"]
    prompts = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6]]
    plain = [_reference(model, p, 20) for p in prompts]
    stop = {plain[0][4]}  # the 5th token of the first sequence stops it (and maybe others)
    engine = Engine(model, DeviceTreeDrafter(draft), ["beam:3x2"], max_batch=2, max_seqlen=64)
    reqs = engine.run([Request(p, max_new_tokens=20, stop_token_ids=frozenset(stop)) for p in prompts])
    for req, p in zip(reqs, prompts):
        assert req.output == _reference(model, p, 20, stop)
    assert reqs[0].finish_reason == "stop" and len(reqs[0].output) <= 5


def test_plain_engine_and_goodput_choice_equal_plain(models):
    model, draft = models["mamba2"], models["draft"]
    prompts = [[5, 9, 13], [2], [40, 41, 42, 43]]
    engine = Engine(model, DeviceTreeDrafter(draft), ["none", "chain:2", "static:2,1", "beam:2x2"],
                    max_batch=3, max_seqlen=96, goodput=True)
    reqs = engine.run([Request(p, max_new_tokens=30) for p in prompts])
    assert [r.output for r in reqs] == [_reference(model, p, 30) for p in prompts]
    tried = {row["shape"] for row in engine.goodput.table() if row["steps"] > 0}
    assert tried == {"none", "chain:2", "static:2,1", "beam:2x2"}
    assert {row["sampled"] for row in engine.goodput.table()} == {False}  # greedy traffic only so far
    engine.run([Request(p, max_new_tokens=12, params=SamplingParams(temperature=1.0)) for p in prompts])
    steps = {(row["shape"], row["sampled"]): row["steps"] for row in engine.goodput.table()}
    assert sum(n for (_, sampled), n in steps.items() if sampled) > 0  # sampled steps fed their own statistics
    assert {s: n for (s, sampled), n in steps.items() if not sampled} == {
        row["shape"]: row["steps"] for row in engine.goodput.modes[False].table()}


def test_host_drafter_trees_are_padded_into_the_step(models):
    model = models["hybrid"]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 9, 8, 9], [4]]
    ngram = create_drafter("ngram")
    reqs = [Request(p, max_new_tokens=25, drafter_session=ngram.open(p, SamplingParams())) for p in prompts]
    engine = Engine(model, "host", max_batch=2, max_seqlen=64)
    engine.run(reqs)
    assert [r.output for r in reqs] == [_reference(model, p, 25) for p in prompts]


def test_cancel_frees_the_slot(models):
    model, draft = models["mamba2"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["chain:2"], max_batch=1, max_seqlen=64)
    a = engine.add(Request([1, 2, 3], max_new_tokens=40))
    b = engine.add(Request([4, 5], max_new_tokens=6))
    engine.step()
    a.cancel()
    while engine.has_work:
        engine.step()
    assert a.finish_reason == "cancelled" and len(a.output) < 40
    assert b.output == _reference(model, [4, 5], 6)
    assert engine.num_running == 0


def test_generate_takes_a_list_of_prompts(models):
    model, draft = models["hybrid"], models["draft"]
    prompts = [[5, 6, 7], [8], [1, 1, 2, 3, 5]]
    outs = stree.generate(model, prompts, drafter="mamba", draft_model=draft, tree="beam:3x2", max_new_tokens=12)
    assert isinstance(outs, list) and len(outs) == 3
    assert [o.token_ids for o in outs] == [_plain(model, p, 12) for p in prompts]
    assert all(o.stats["mean_accepted_length"] >= 1.0 for o in outs)
    one = stree.generate(model, prompts[0], drafter="mamba", draft_model=draft, tree="auto", max_new_tokens=12)
    assert one.token_ids == outs[0].token_ids


def test_bad_requests_are_refused_before_any_work(models):
    engine = Engine(models["mamba2"], None, max_batch=1, max_seqlen=16)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(Request([], max_new_tokens=3))
    with pytest.raises(ValueError, match="prompt token id 1000000 is outside"):
        engine.add(Request([10**6], max_new_tokens=3))
    with pytest.raises(ValueError, match="tokens per sequence"):
        engine.add(Request([1] * 10, max_new_tokens=100))
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(models["mamba2"], None, ["chain:2"])


@pytest.mark.parametrize("target", ["mamba2", "hybrid"])
def test_catch_up_equals_feeding_the_backlog_token_by_token(models, target):
    model = models[target]
    gen = torch.Generator().manual_seed(5)
    ctx = [torch.randint(0, model.vocab_size, (k,), generator=gen) for k in (4, 1, 7)]
    lazy, eager = DeviceTreeDrafter(model), DeviceTreeDrafter(model)
    for d in (lazy, eager):
        d.new_slots(3, 64)
        for i, c in enumerate(ctx):
            d.prefill_slot(i, c)
    backlog = torch.randint(0, model.vocab_size, (3, 6), generator=gen)
    count = torch.tensor([3, 0, 6])
    lazy.catch_up(backlog, count)
    for i in range(3):  # row i alone, one step per backlog token
        one = DeviceTreeDrafter(model)
        one.new_slots(1, 64)
        one.prefill_slot(0, ctx[i])
        for t in backlog[i, : int(count[i])]:
            one.step_roots(t.reshape(1))
        eager.state.assign_row(i, one.state)
    assert torch.equal(lazy.state.seqlen, eager.state.seqlen)
    for a, b in zip(lazy.state.layers, eager.state.layers):
        for name in vars(a):
            got, want = getattr(a, name), getattr(b, name)
            if name in ("k_cache", "v_cache"):  # rows past each sequence's length are scratch
                for i, n in enumerate(lazy.state.seqlen.tolist()):
                    torch.testing.assert_close(got[i, :n], want[i, :n], atol=1e-5, rtol=1e-5)
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_plain_steps_leave_a_lazy_drafter_behind_and_it_catches_up_exactly(models):
    """Self-drafting (draft == target) accepts every drafted token only if the draft state is in sync:
    runs of plain steps longer than the backlog, then drafts, with sequences joining mid-run."""
    from stree.verifier.decode import drafter_slots as engine_mod

    model = models["hybrid"]
    prompts = [[5, 9, 13], [2], [40, 41, 42, 43], [7, 7]]
    engine = Engine(model, DeviceTreeDrafter(model), ["none", "chain:3"], max_batch=2, max_seqlen=128)
    plain, chain = engine.shapes
    schedule = [plain] * (engine_mod.CATCH_UP + 4) + [chain, plain, plain, chain, chain] + [plain] * 3
    calls = []

    def choose(sampled=False):
        calls.append(1)
        return schedule[(len(calls) - 1) % len(schedule)]

    engine._choose = choose
    reqs = engine.run([Request(p, max_new_tokens=60) for p in prompts])
    assert [r.output for r in reqs] == [_reference(model, p, 60) for p in prompts]
    spec_steps = sum(r.num_draft_tokens for r in reqs) // 3
    assert spec_steps > 0
    assert sum(r.num_accepted_draft_tokens for r in reqs) == 3 * spec_steps


def test_goodput_defers_the_drafter_until_a_draft_and_refreshes_it_exactly(models):
    """Under goodput control a lazy drafter is not prefilled at admission, and a plain run longer than the
    backlog leaves it stale; the first draft after that prefills it from prompt + output. Self-drafting
    (draft == target) accepts every drafted token only if that refresh is exact."""
    from stree.verifier.decode import drafter_slots as engine_mod

    model = models["hybrid"]
    drafter = DeviceTreeDrafter(model)
    engine = Engine(model, drafter, ["none", "chain:3"], max_batch=2, max_seqlen=128, goodput=True)
    plain, chain = engine.shapes
    schedule = [plain] * (engine_mod.CATCH_UP + 3) + [chain, plain, chain, chain] + [plain] * 2
    calls, prefills = [], []
    engine._choose = lambda sampled=False: (calls.append(1), schedule[(len(calls) - 1) % len(schedule)])[1]
    real = drafter.prefill_slots
    drafter.prefill_slots = lambda slots, ctxs: (prefills.extend([len(calls)] * len(slots)), real(slots, ctxs))[1]
    prompts = [[5, 9, 13], [2], [40, 41, 42, 43], [7, 7]]
    reqs = engine.run([Request(p, max_new_tokens=70) for p in prompts])
    assert [r.output for r in reqs] == [_reference(model, p, 70) for p in prompts]
    assert prefills and min(prefills) > engine_mod.CATCH_UP  # nothing before the first draft was chosen
    assert engine.metrics["drafter_refreshes"] == len(prefills)
    spec_steps = sum(r.num_draft_tokens for r in reqs) // 3
    assert spec_steps > 0 and sum(r.num_accepted_draft_tokens for r in reqs) == 3 * spec_steps


def test_plain_choices_never_run_the_drafter(models):
    """When goodput control keeps choosing plain steps the drafter costs nothing: no prefill, no backlog, no
    draft-model step per plain step (such a step costs about a tenth of the demo target's plain step)."""
    model, draft = models["mamba2"], models["draft"]
    drafter = DeviceTreeDrafter(draft)
    engine = Engine(model, drafter, ["none", "chain:2"], max_batch=2, max_seqlen=96, goodput=True)
    engine._choose = lambda sampled=False: engine.shapes[0]
    drafter.prefill_slots = drafter.catch_up = drafter.step_roots = None  # would raise if called
    prompts = [[5, 9, 13], [2], [4, 4]]
    reqs = engine.run([Request(p, max_new_tokens=25) for p in prompts])
    assert [r.output for r in reqs] == [_reference(model, p, 25) for p in prompts]
    assert int(engine.drafter.backlog_len.max()) == 0 and engine.drafter.behind == 0


def test_a_draft_that_needed_a_drafter_refresh_is_charged_for_it(models):
    """Leaving plain steps for a draft refreshes the stale drafter first; goodput control must see that
    refresh with the draft's sample (it charges a part of it), or it keeps switching at a loss."""
    import time as _time

    model, draft = models["mamba2"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["none", "chain:2"], max_batch=2, max_seqlen=96, goodput=True)
    refresh = engine._refresh_drafter
    engine._refresh_drafter = lambda: (_time.sleep(0.2), refresh())[1]
    seen = []
    observe = engine.goodput.observe

    def seeing(shape, tau, seconds, refresh_s, **kw):
        seen.append((str(shape), refresh_s, kw.get("refreshed")))
        observe(shape, tau, seconds, refresh_s, **kw)

    engine.goodput.observe = seeing
    engine.run([Request([5, 9, 13], max_new_tokens=12), Request([2], max_new_tokens=12)])
    assert engine.metrics["drafter_refreshes"] == 2
    chain = [(sec, rows) for shape, sec, rows in seen if shape == "chain:2"]
    # the refresh is charged with the number of sequences it prefilled (both): goodput prices refreshes per sequence
    assert chain and chain[0][0] >= 0.2 and chain[0][1] == 2 and all(sec < 0.2 for sec, _ in chain[1:])


def test_a_step_that_captured_a_graph_is_no_cost_sample(models):
    """The first run of a shape on CUDA also captures its graph (seconds, not a step's cost); feeding that
    time to goodput control would make it shun the shape, plain decoding included, for hundreds of steps."""
    model, draft = models["mamba2"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["none", "chain:2"], max_batch=2, max_seqlen=96, goodput=True)
    run, launch = engine._run, engine._launch
    launched = []  # (shape, whether its step captured a graph)

    def run_and_pretend_to_capture(key):
        clean = run(key)
        # CPU has no graphs: each key's first run stands for the one that captured its graph
        engine.graphs.graphs.setdefault(key, None)
        return clean

    def spy(t0, shape, *args):
        before = len(engine.graphs)
        out = launch(t0, shape, *args)
        launched.append((str(shape), len(engine.graphs) > before))
        return out

    engine._run, engine._launch = run_and_pretend_to_capture, spy
    engine.run([Request([5, 9, 13], max_new_tokens=30), Request([2], max_new_tokens=30)])
    steps = {row["shape"]: row["steps"] for row in engine.goodput.table()}
    captured = collections.Counter(s for s, c in launched if c)
    assert captured["none"] >= 1 and captured["chain:2"] >= 1
    assert steps == {s: sum(1 for t, c in launched if t == s and not c) for s in ("none", "chain:2")}


def test_warm_up_runs_every_step_kind_then_starts_afresh(models):
    """warm_up (called by the server at start) runs each shape greedy and sampled plus the drafter's
    catch-up, so each CUDA graph is captured before any request; then statistics start empty and
    generation is still exact. On the CPU there are no graphs, so the engine is told it has them."""
    model, draft = models["hybrid"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["none", "chain:2", "beam:2x2"], max_batch=2, max_seqlen=96,
                    goodput=True)
    assert engine.warm_up() == 0  # no CUDA graphs: nothing to do
    engine.graphs.enabled = True  # capture fails on the CPU and the engine falls back to eager steps
    keys = set()
    run = engine._run
    engine._run = lambda key: (keys.add(_bools(key)), run(key))[1]
    engine.warm_up()
    # plain steps with the drafter stale (not fed) and live (fed its backlog), greedy and sampled
    assert keys == {("plain", False, False, False), ("plain", False, False, True), ("plain", True, False, False),
                    ("plain", True, False, True), ("tree", False, False), ("tree", True, False), ("catch_up",)}
    assert all(row["steps"] == 0 for row in engine.goodput.table()) and not engine.metrics
    assert engine.num_running == 0 and not engine.has_work
    # a drafter refresh was timed: until one is measured, that (not a whole admission) is what leaving plain costs
    assert engine.chooser.priors.refresh_s > 0 and engine.goodput.refresh_guess == engine.chooser.priors.refresh_s
    prompts = [[5, 9, 13], [2]]
    reqs = engine.run([Request(p, max_new_tokens=20) for p in prompts])
    assert [r.output for r in reqs] == [_reference(model, p, 20) for p in prompts]
    assert engine.goodput.refresh_guess == engine.chooser.priors.refresh_s  # admissions did not replace it


def test_a_capture_that_fails_after_its_warm_up_runs_loses_nothing(models, monkeypatch):
    """capture_graph runs the step twice for real before it captures; when the capture then fails (an op
    the graph cannot hold), the engine goes eager, and the state those runs advanced must be restored."""
    from stree.verifier.decode import step_graphs

    def warm_up_then_fail(fn, warmup=1):
        for _ in range(warmup):
            fn()
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(step_graphs, "capture_graph", warm_up_then_fail)
    model, draft = models["hybrid"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["chain:2"], max_batch=2, max_seqlen=96)
    engine.graphs.enabled = True
    prompts = [[5, 9, 13], [2, 4]]
    reqs = engine.run([Request(p, max_new_tokens=12) for p in prompts])
    assert engine.graphs.failed
    assert [r.output for r in reqs] == [_reference(model, p, 12) for p in prompts]


def test_mixed_prompt_lengths_share_one_engine(models):
    """generate() keeps one engine (and its CUDA graphs) per drafter: a call that needs less room than
    the cached engine has reuses it, one that needs more replaces it with a larger one, never a smaller."""
    from stree.verifier.decode.loop import engine_for

    model, draft = models["mamba2"], models["draft"]
    drafter = DeviceTreeDrafter(draft)
    from stree.protocols.drafter import DEFAULT_BUDGET

    args = (["chain:2"], 1, False, DEFAULT_BUDGET)
    short = engine_for(model, drafter, args[0], args[1], 300, *args[2:])
    assert engine_for(model, drafter, args[0], args[1], 900, *args[2:]) is short
    long = engine_for(model, drafter, args[0], args[1], 1500, *args[2:])
    assert long is not short
    assert engine_for(model, drafter, args[0], args[1], 300, *args[2:]) is long
    assert engine_for(model, drafter, args[0], args[1], 1900, *args[2:]) is long


def test_warm_up_engines_warms_each_goodput_engine_once(models):
    """Benchmarks call warm_up_engines before every timed row: an engine it already warmed is left alone (its
    graphs are held), and output stays exact. On the CPU the engine is told it has graphs (captures fail and it
    runs eagerly), as in the warm-up test above."""
    from stree.verifier.decode.engine_pool import EnginePool
    from stree.verifier.decode.loop import generate, warm_up_engines

    model, draft = models["mamba2"], models["draft"]
    pool = EnginePool()
    prompt = [3, 5, 7]
    generate(model, prompt, drafter="mamba", draft_model=draft, tree="auto", max_new_tokens=6, pool=pool)
    engine, = pool.engines(model)
    engine.graphs.enabled = True
    assert warm_up_engines(model, pool) == 1 and engine.warmed_up
    assert warm_up_engines(model, pool) == 0
    out = generate(model, prompt, drafter="mamba", draft_model=draft, tree="auto", max_new_tokens=12, pool=pool)
    assert out.token_ids == _reference(model, prompt, 12)


def test_a_named_drafter_keeps_one_engine_across_generate_calls(models):
    """generate(drafter="mamba") builds the drafter once per target and options, so its engine (and the
    CUDA graphs it holds) serves every later call: before, each call built a new drafter and engine."""
    from stree.verifier.decode.engine_pool import EnginePool
    from stree.verifier.decode.loop import generate

    model, draft = models["mamba2"], models["draft"]
    pool = EnginePool()
    prompt = [3, 5, 7]
    first = generate(model, prompt, drafter="mamba", draft_model=draft, tree="chain:2", max_new_tokens=6, pool=pool)
    engines = pool.engines(model)
    second = generate(model, prompt, drafter="mamba", draft_model=draft, tree="chain:2", max_new_tokens=6, pool=pool)
    assert pool.engines(model) == engines and second.token_ids == first.token_ids
    generate(model, prompt, drafter="mamba", draft_model=draft, tree="chain:3", max_new_tokens=6, pool=pool)
    assert len(pool.engines(model)) == len(engines) + 1  # other options: another drafter


def test_release_engines_forgets_one_drafters_engine_or_all(models):
    """release_engines drops the kept engine of the drafter named (the others stay and still serve exactly),
    or every kept engine; a later generate builds afresh and is still exact."""
    from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
    from stree.verifier.decode.engine_pool import EnginePool
    from stree.verifier.decode.loop import generate, release_engines

    model = models["mamba2"]
    pool = EnginePool()
    prompt = [3, 5, 7]
    mine, other = (OracleDeviceDrafter(model.vocab_size, 1, "chain:2", model.device) for _ in range(2))
    generate(model, prompt, drafter=mine, max_new_tokens=6, pool=pool)
    kept = generate(model, prompt, drafter=other, max_new_tokens=6, pool=pool)
    drafters = lambda: {e.drafter.drafter for e in pool.engines(model)}  # noqa: E731
    assert drafters() == {mine, other}
    assert release_engines(model, mine, pool) == 1 and drafters() == {other}
    assert release_engines(model, mine, pool) == 0
    assert generate(model, prompt, drafter=other, max_new_tokens=6, pool=pool).token_ids == kept.token_ids
    assert release_engines(model, pool=pool) == 1 and not pool.engines(model)
    assert generate(model, prompt, drafter=mine, max_new_tokens=9, pool=pool).token_ids == _reference(model, prompt, 9)


def test_an_engine_whose_drafter_was_taken_over_refuses_to_step(models):
    """Two engines over one device drafter would share its slot state: the later one owns it, and the
    earlier one raises instead of drafting from state it no longer owns."""
    model, draft = models["mamba2"], models["draft"]
    drafter = DeviceTreeDrafter(draft)
    old = Engine(model, drafter, ["chain:2"], max_batch=1, max_seqlen=64)
    new = Engine(model, drafter, ["chain:2"], max_batch=1, max_seqlen=64)
    assert new.drafter.owned and not old.drafter.owned
    with pytest.raises(RuntimeError, match="another engine"):
        old.run([Request([1, 2], max_new_tokens=2)])
    assert new.run([Request([1, 2], max_new_tokens=4)])[0].output == _reference(model, [1, 2], 4)


def test_a_request_with_top_k_gets_its_own_step_after_unfiltered_sampled_steps(models):
    """Sampled steps skip the top-k/top-p sorts while no row filters; the step key says which, so a graph
    captured without filters is never replayed for a row that has one. A top_k=1 row at T=1 is greedy."""
    model, draft = models["hybrid"], models["draft"]
    engine = Engine(model, DeviceTreeDrafter(draft), ["chain:2"], max_batch=1, max_seqlen=96)
    keys = []
    run = engine._run
    engine._run = lambda key: (keys.append(key), run(key))[1]
    free = Request([5, 9, 13], max_new_tokens=10, params=SamplingParams(temperature=1.0, seed=1))
    top1 = Request([2, 4], max_new_tokens=10, params=SamplingParams(temperature=1.0, top_k=1, seed=2))
    engine.run([free, top1])  # one slot: top1 joins after free has left
    tree_keys = [k for k in keys if k.kind == "tree"]
    assert (tree_keys[0].sampled, tree_keys[0].filtered) == (True, False)
    assert (tree_keys[-1].sampled, tree_keys[-1].filtered) == (True, True)
    assert top1.output == _reference(model, [2, 4], 10)


def _bools(key) -> tuple:
    """A step key as its kind and its flags (the shape left out)."""
    if key.kind == "plain":
        return (key.kind, key.sampled, key.filtered, key.feed)
    return (key.kind,) if key.kind == "catch_up" else (key.kind, key.sampled, key.filtered)


def _prefill_batches(engine) -> list:
    """Spy on the engine's prefill passes: how many prompts joined in each admission."""
    batches, real = [], engine.admission.prefiller.run
    engine.admission.prefiller.run = lambda prompts, *a, **k: batches.append(len(prompts)) or real(prompts, *a, **k)
    return batches


class FixedCosts(AdmissionCosts):
    """Admission and step costs held fixed (the engine's measurements are wall times on the CPU: not repeatable)."""

    def observe_admit(self, seconds):
        pass

    def observe_step(self, seconds):
        pass


@pytest.mark.parametrize("cap, second_limit, admit_s, want",
                         [(32, 6, 1.0, [2, 2]), (0, 6, 1.0, [2, 1, 1]), (32, 40, 1.0, [2, 1, 1]),
                          (32, 6, 0.01, [2, 1, 1])],
                         ids=["held", "cap-0", "too-far-to-wait", "admission-cheaper-than-waiting"])
def test_queued_prompts_wait_briefly_to_share_one_prefill(models, cap, second_limit, admit_s, want):
    """Four prompts, two slots: when the first sequence ends three steps before the second, the two queued prompts
    wait for it and join in one prefill; not when holding is off, when the second is not about to finish, or when
    the idle steps would cost more than an admission (steps 10 ms here). Outputs equal plain greedy either way."""
    model = models["mamba2"]
    engine = Engine(model, None, ["none"], max_batch=2, max_seqlen=64, admit_hold_steps=cap)
    engine.admission.costs = FixedCosts(admit_s=admit_s, step_s=0.01)
    batches = _prefill_batches(engine)
    prompts, limits = [[1, 2], [3, 4, 5], [6, 7], [7, 8]], [3, second_limit, 5, 5]
    reqs = engine.run([Request(p, max_new_tokens=m) for p, m in zip(prompts, limits)])
    assert [r.output for r in reqs] == [_reference(model, p, m) for p, m in zip(prompts, limits)]
    assert batches == want
    assert (engine.metrics["admission_holds"] > 0) == (want == [2, 2])


def test_no_hold_when_every_queued_prompt_fits(models):
    model = models["mamba2"]
    engine = Engine(model, None, ["none"], max_batch=2, max_seqlen=64)
    engine.admission.costs = FixedCosts(admit_s=1.0, step_s=0.01)
    batches = _prefill_batches(engine)
    engine.run([Request(p, max_new_tokens=m) for p, m in zip([[1, 2], [3, 4], [5, 6]], [3, 6, 4])])
    assert batches == [2, 1] and engine.metrics["admission_holds"] == 0
    with pytest.raises(ValueError, match="admit_hold_steps"):
        Engine(model, None, ["none"], max_batch=2, max_seqlen=64, admit_hold_steps=-1)
    with pytest.raises(ValueError, match="admit_hold_steps"):
        stree.generate(model, [[1, 2], [3]], max_new_tokens=2, admit_hold_steps=1.5)


def test_admission_hold_budget_weighs_idle_steps_against_one_admission():
    costs = AdmissionCosts()
    assert costs.hold_steps(1, 4, 32) == 0  # nothing measured yet: no hold
    costs.observe_admit(0.0065)
    costs.observe_step(0.0004)
    assert costs.hold_steps(1, 4, 32) == 32  # demo pair, batch 4: 65 idle slot-steps per admission, capped
    assert costs.hold_steps(3, 4, 100) == 21
    costs.step_s = 0.0036  # 2.7B-like step: holding one of four slots pays for 7 steps at most
    assert costs.hold_steps(1, 4, 32) == 7
    costs.observe_step(0.0036)
    costs.observe_admit(0.0165)  # running means: 0.0065 + 0.2 * 0.01
    assert costs.admit_s == pytest.approx(0.0085)
    assert steps_to_finish(12, 30, 10) == 4.0 and steps_to_finish(5, 0, 0) == 5.0
    assert should_hold(3, 1, 0, 8, [9.0, 4.0]) and not should_hold(3, 1, 5, 8, [4.0])
    assert not should_hold(1, 1, 0, 8, [1.0]) and not should_hold(3, 1, 0, 8, [])


def test_a_new_engine_over_the_same_drafter_starts_from_the_acceptance_it_measured(models):
    """Acceptance is the drafter's and the traffic's, not the batch size's: an engine built for another batch size
    over the same drafter is primed with the tau its predecessor measured, greedy and sampled apart, and output
    stays exact."""
    from stree.protocols.drafter import DEFAULT_BUDGET
    from stree.protocols.tree_shape import TreeShape
    from stree.verifier.decode.engine_pool import EnginePool

    model, draft = models["mamba2"], models["draft"]
    engine_for = EnginePool().engine_for
    drafter = DeviceTreeDrafter(draft)
    shapes = [TreeShape.parse(s) for s in ("none", "chain:2", "chain:3")]
    first = engine_for(model, drafter, shapes, 2, 128, False, DEFAULT_BUDGET)
    first.run([Request(p, max_new_tokens=24) for p in ([3, 5, 7], [1, 2])])
    first.run([Request([4, 4], max_new_tokens=16, params=SamplingParams(temperature=1.0))])
    first.goodput.mode(False).stats[shapes[2]].retry_every = 2048  # as if chain:3 had lost its retries
    learned = first.goodput.learned()
    assert {sampled for sampled, _ in learned} == {False, True}
    second = engine_for(model, drafter, shapes, 3, 128, False, DEFAULT_BUDGET)
    assert second is not first
    for (sampled, shape), (tau, retry_every) in learned.items():
        r = second.goodput.mode(sampled).stats[shape]
        assert r.primed and r.tau == tau and r.retry_every == retry_every and r.seen == 0
    assert second.goodput.mode(False).stats[shapes[2]].retry_every == 2048  # it is retried as rarely
    assert second.goodput.mode(False).stats[shapes[0]].tau == 1.0  # plain decoding: exact, never primed
    depths = first.goodput.learned_depths()  # chain acceptance per depth, pooled over chain:2 and chain:3 steps
    assert set(depths) == {False, True}
    for sampled, by_source in depths.items():
        assert set(by_source) == {""}  # the draft model's chains: the only source here
        assert second.goodput.mode(sampled).depths.rate == by_source[""].rate
    other = engine_for(model, DeviceTreeDrafter(draft), shapes, 3, 128, False, DEFAULT_BUDGET)
    assert not any(r.primed for r in other.goodput.mode(False).stats.values())  # another drafter starts afresh
    second = engine_for(model, drafter, shapes, 3, 128, False, DEFAULT_BUDGET)  # the drafter's engine again
    reqs = second.run([Request(p, max_new_tokens=12) for p in ([3, 5, 7], [9], [2, 2, 2])])
    assert [r.output for r in reqs] == [_reference(model, p, 12) for p in ([3, 5, 7], [9], [2, 2, 2])]
