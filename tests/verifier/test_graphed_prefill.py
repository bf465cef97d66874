"""PrefillRunner (admission and drafter refresh): row- and width-padded passes through a scratch state.

On the CPU the runner takes the path its CUDA graphs take (``pad_rows=True``): rows padded to a power
of two, finished rows reused as padding, a row handed over as soon as its context ends. Every
delivered row must equal a per-context prefill, whatever the mix of lengths.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from stree.cli.init_model import init_model
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.graphed_prefill import PrefillRunner

ROOM = 48


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphed_prefill")
    return load_model(init_model(root / "h", arch="hybrid", d_model=32, n_layer=3, attn_layers=[1], vocab_size=64,
                                 seed=7))


def _reference(model, ctx):
    state = model.new_state(1, ROOM)
    hidden = torch.zeros(model.config.d_model)
    if ctx:
        _, h = model.prefill(torch.tensor([ctx]), state, return_hidden=True)
        hidden = h[0, -1]
    return state, hidden


def _collect(model, runner, contexts):
    """Run ``contexts`` through ``runner``; per context index, a copy of its delivered state row and hidden."""
    got = {}

    def deliver(index, first, hidden):
        rows = runner.scratch.rows(len(index), first).clone()
        for k, j in enumerate(index):
            assert j not in got, "a context was delivered twice"
            got[j] = (rows.rows(1, k).clone(), hidden[k].clone())

    assert runner.run(contexts, deliver)
    return got


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=9), max_rows=st.integers(1, 5),
       chunk=st.sampled_from([4, 7, 16]), seed=st.integers(0, 2**16))
def test_padded_runner_delivers_what_a_prefill_per_context_leaves(hybrid, lengths, max_rows, chunk, seed):
    """Random length mixes, groups (more contexts than rows), row buckets with finished rows as padding."""
    gen = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]
    runner = PrefillRunner(hybrid, max_rows, ROOM, chunk=chunk, pad_rows=True)
    got = _collect(hybrid, runner, contexts)
    assert sorted(got) == list(range(len(contexts)))
    for j, ctx in enumerate(contexts):
        ref, ref_hidden = _reference(hybrid, ctx)
        state, hidden = got[j]
        assert int(state.seqlen[0]) == len(ctx)
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(state.layers, ref.layers):
            for name, t in vars(theirs).items():
                m = getattr(mine, name)
                if name.endswith("_cache"):  # only the slots below the length are the sequence's
                    m, t = m[:, : len(ctx)], t[:, : len(ctx)]
                torch.testing.assert_close(m, t, atol=1e-5, rtol=1e-5, msg=f"context {j} ({len(ctx)}) {name}")


def test_a_row_used_as_padding_after_it_ended_would_be_wrong_if_delivered_late(hybrid):
    """The reason rows are delivered the moment they end: a finished row runs as padding in later chunks and
    its scratch state changes. Checks that it does change, so the delivery order is what keeps it exact."""
    runner = PrefillRunner(hybrid, 4, ROOM, chunk=4, pad_rows=True)
    short, long = [5, 6, 7], list(range(1, 20))
    snapshot = {}

    def deliver(index, first, hidden):
        for k, j in enumerate(index):
            snapshot[j] = runner.scratch.rows(1, first + k).clone()

    runner.run([long, long, long, short], deliver)  # 3 live rows run at the 4-row bucket, the short one as padding
    after = runner.scratch.rows(1, 3)  # the short context's row once the long ones are done
    ref, _ = _reference(hybrid, short)
    ssm = [n for n in vars(ref.layers[0]) if not n.endswith("_cache")][-1]
    torch.testing.assert_close(getattr(snapshot[3].layers[0], ssm), getattr(ref.layers[0], ssm), atol=1e-5,
                               rtol=1e-5)
    assert not torch.allclose(getattr(after.layers[0], ssm), getattr(ref.layers[0], ssm))


def test_a_run_stops_when_every_requester_went_away(hybrid):
    runner = PrefillRunner(hybrid, 2, ROOM, chunk=4, pad_rows=True)
    calls = []
    assert not runner.run([list(range(1, 20))], lambda *a: calls.append(a), keep_going=lambda: False)
    assert calls == []


def test_a_context_over_the_scratch_room_is_refused(hybrid):
    runner = PrefillRunner(hybrid, 2, 8, chunk=4, pad_rows=True)
    with pytest.raises(ValueError, match="over the prefill"):
        runner.run([list(range(1, 20))], lambda *a: None)


def test_engine_with_padded_admission_and_refresh_equals_plain_greedy(hybrid, tmp_path):
    """The engine's admission and its draft model's refresh through the padded path: greedy output unchanged."""
    draft = load_model(init_model(tmp_path / "d", d_model=16, n_layer=1, vocab_size=64, seed=5))
    prompts = [list(range(1, 30)), [3, 4], [9] * 17, [2, 8, 1, 1, 5]]
    drafter = DeviceTreeDrafter(draft)
    engine = Engine(hybrid, drafter, ["chain:2", "beam:2x2"], max_batch=3, max_seqlen=96, prefill_chunk=8)
    engine.admission.prefiller = PrefillRunner(hybrid, 3, engine.max_seqlen, chunk=8, pad_rows=True)
    drafter.prefiller = PrefillRunner(draft, 3, engine.max_seqlen, chunk=8, pad_rows=True)
    outs = [r.output for r in engine.run([Request(p, 12) for p in prompts])]
    plain = Engine(hybrid, None, ["none"], max_batch=1, max_seqlen=96)
    assert outs == [plain.run([Request(p, 12)])[0].output for p in prompts]


def test_contexts_may_be_token_lists_or_tensors():
    """``pack_ids`` takes a context as a list or as a 1-D tensor (what a caller holding a prompt tensor passes)."""
    from stree.verifier.model.batch_prefill import pack_ids

    lists = [[3, 1, 4], [1, 5]]
    got = pack_ids([torch.tensor(c) for c in lists], 4, 5)
    assert torch.equal(got, pack_ids(lists, 4, 5))
    assert got.tolist() == [[3, 1, 4, 0, 0], [1, 5, 0, 0, 0], [0] * 5, [0] * 5]
