"""Chunked prefill (the server's cancel points) leaves greedy output exactly as one-shot prefill."""

from __future__ import annotations

import torch

from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import init_model, load_model


def test_prefill_in_chunks_equals_one_shot(tmp_path):
    model = load_model(init_model(tmp_path / "h", arch="hybrid", d_model=32, n_layer=2, attn_layers=[1],
                                  vocab_size=64, seed=11))
    prompts = [torch.randint(1, 64, (n,)).tolist() for n in (1, 2, 37, 90)]
    outs = []
    for chunk in (512, 7):
        engine = Engine(model, None, ["none"], max_batch=2, max_seqlen=256, prefill_chunk=chunk)
        reqs = engine.run([Request(p, 10) for p in prompts])
        outs.append([r.output for r in reqs])
    assert outs[0] == outs[1]


def test_cancel_during_prefill_keeps_the_slot_free(tmp_path):
    model = load_model(init_model(tmp_path / "m", d_model=32, n_layer=1, vocab_size=64, seed=2))
    engine = Engine(model, None, ["none"], max_batch=1, max_seqlen=256, prefill_chunk=4)
    req = Request(list(range(1, 60)), 5)
    calls = {"n": 0}
    real = model.prefill_padded

    def prefill(ids, lengths, state, **kwargs):  # the client goes away after the third chunk
        calls["n"] += 1
        if calls["n"] == 3:
            req.cancel()
        return real(ids, lengths, state, **kwargs)

    model.prefill_padded = prefill
    engine.add(req)
    engine.step()
    assert calls["n"] == 3 and engine.slots == [None] and not req.admitted


def test_prefill_contexts_equals_one_prefill_per_context(tmp_path):
    """Admission's batched prefill (length-sorted, chunked, right-padded) leaves every row as its own
    prefill would, empty contexts included, and hands back each context's last hidden state."""
    from stree.verifier.model.batch_prefill import prefill_contexts

    model = load_model(init_model(tmp_path / "h", arch="hybrid", d_model=32, n_layer=3, attn_layers=[1],
                                  vocab_size=64, seed=5))
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (0, 9, 1, 23, 9, 4)]
    pre = prefill_contexts(model, contexts, chunk=5, room=3)
    for k, j in enumerate(pre.order):
        ctx = contexts[j]
        one = model.new_state(1, len(ctx) + 3)
        hidden = torch.zeros(model.config.d_model)
        if ctx:
            _, h = model.prefill(torch.tensor([ctx]), one, return_hidden=True)
            hidden = h[0, -1]
        assert int(pre.state.seqlen[k]) == len(ctx)
        torch.testing.assert_close(pre.hidden[k], hidden, atol=1e-5, rtol=1e-5)
        row = pre.state.select(torch.tensor([k]))
        tok = torch.tensor([7])
        torch.testing.assert_close(model.step(tok, row), model.step(tok, one), atol=1e-5, rtol=1e-5)


def test_one_request_cancelled_mid_prefill_leaves_the_others_admitted(tmp_path):
    model = load_model(init_model(tmp_path / "m", d_model=32, n_layer=1, vocab_size=64, seed=2))
    engine = Engine(model, None, ["none"], max_batch=3, max_seqlen=256, prefill_chunk=4)
    reqs = [Request(list(range(1, 40)), 5), Request(list(range(3, 20)), 5), Request([9, 8, 7], 5)]
    real = model.prefill_padded
    calls = {"n": 0}

    def prefill(ids, lengths, state, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            reqs[1].cancel()
        return real(ids, lengths, state, **kwargs)

    model.prefill_padded = prefill
    for r in reqs:
        engine.add(r)
    engine.step()
    assert [r.admitted for r in reqs] == [True, False, True]
    assert engine.slots[1] is None and engine.slots[0] is reqs[0] and engine.slots[2] is reqs[2]
    model.prefill_padded = real
    while engine.has_work:
        engine.step()
    plain = Engine(model, None, ["none"], max_batch=1, max_seqlen=256)
    for r in (reqs[0], reqs[2]):
        assert r.output == plain.run([Request(r.prompt_ids, 5)])[0].output


def test_prefill_warm_up_changes_no_output(tmp_path):
    """warm_up_prefill runs every width bucket through the target and the drafter's scratch slots."""
    from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter

    model = load_model(init_model(tmp_path / "m", d_model=32, n_layer=2, vocab_size=64, seed=4))
    draft = load_model(init_model(tmp_path / "d", d_model=16, n_layer=1, vocab_size=64, seed=5))
    prompts = [list(range(1, 30)), [3, 4]]
    outs = []
    for warm in (False, True):
        engine = Engine(model, DeviceTreeDrafter(draft), ["chain:2"], max_batch=2, max_seqlen=128, prefill_chunk=32)
        if warm:
            engine.warm_up_prefill()
        outs.append([r.output for r in engine.run([Request(p, 12) for p in prompts])])
    assert outs[0] == outs[1]
