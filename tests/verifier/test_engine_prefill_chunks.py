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
    real = model.prefill

    def prefill(ids, state, **kwargs):  # the client goes away after the third chunk
        calls["n"] += 1
        if calls["n"] == 3:
            req.cancel()
        return real(ids, state, **kwargs)

    model.prefill = prefill
    engine.add(req)
    engine.step()
    assert calls["n"] == 3 and engine.slots == [None] and not req.admitted
