"""Lookup drafting inside the engine's step: greedy output equals plain greedy at batch 1, 3 and 8 for device n-gram,
retrieval and fused trees, through ``stree.generate`` and through an engine under goodput control.

The targets loop (``lookup_helpers.looping_target``), so lookup drafts really get accepted (the assertions on the
mean accepted length check it).
"""

from __future__ import annotations

import pytest
import torch

import stree
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.protocols.registry import create_drafter
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.decode.loop import device_offer

from lookup_helpers import looping_target

VOCAB = 64
NEW = 32


@pytest.fixture(scope="module")
def targets():
    return {"hybrid": looping_target(True, 0), "mamba2": looping_target(False, 0)}


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 24, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def plain(targets):
    """Plain greedy outputs per (arch, batch size): the references."""
    cache = {}

    def get(arch: str, n: int):
        if (arch, n) not in cache:
            cache[(arch, n)] = [r.token_ids for r in stree.generate(targets[arch], _prompts(n), max_new_tokens=NEW)]
        return cache[(arch, n)]

    return get


@pytest.fixture(scope="module")
def datastore(targets):
    """A corpus of the Mamba2 target's own outputs after other prompts: it holds the cycles it falls into."""
    g = torch.Generator().manual_seed(99)
    others = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(12)]
    outs = stree.generate(targets["mamba2"], others, max_new_tokens=60)
    return Datastore.build([o + r.token_ids for o, r in zip(others, outs)], vocab_size=VOCAB)


def _variant(name: str, models, datastore) -> tuple[str, dict]:
    return {"ngram": ("ngram", {"lookup_tree": "chain:4"}),
            "ngram-auto": ("ngram", {}),
            "ngram-trie": ("ngram", {"lookup_tree": "trie:4x3"}),
            "retrieval": ("retrieval", {"datastore": datastore, "lookup_tree": "trie:3x2"}),
            "fused-auto": ("fusion:mamba+ngram", {"tree": "auto", "draft_model": models["draft"]}),
            "fused-beam": ("fusion:mamba+retrieval", {"tree": "beam:3x2", "draft_model": models["draft"],
                                                      "datastore": datastore})}[name]


@pytest.mark.parametrize("variant, arch, batch", [
    ("ngram", "mamba2", 1), ("ngram", "mamba2", 3), ("ngram", "mamba2", 8), ("ngram", "hybrid", 3),
    ("ngram-auto", "mamba2", 3), ("ngram-trie", "mamba2", 3), ("retrieval", "mamba2", 8), ("fused-auto", "mamba2", 1),
    ("fused-auto", "mamba2", 8), ("fused-beam", "mamba2", 3),
])
def test_lookup_greedy_equals_plain_greedy(targets, plain, models, datastore, variant, arch, batch):
    drafter, options = _variant(variant, models, datastore)
    outs = stree.generate(targets[arch], _prompts(batch), drafter=drafter, max_new_tokens=NEW, **options)
    assert [o.token_ids for o in outs] == plain(arch, batch)
    steps = sum(o.stats["steps"] for o in outs)
    if "auto" not in variant:  # (goodput control spends short runs measuring its shapes)
        assert sum(len(o.token_ids) for o in outs) / steps > 1.3, "lookup drafts were hardly accepted"
    shapes = {k for k, v in outs[0].stats["engine_metrics"].items() if k.startswith("steps:") and v}
    assert any("lookup" in k or "fused" in k for k in shapes), shapes


@pytest.mark.parametrize("variant, batch", [("ngram-auto", 8), ("fused-auto", 3)])
def test_goodput_engine_over_lookup_shapes_keeps_greedy_output(targets, plain, models, datastore, variant, batch):
    """An engine under goodput control (plain steps, lookup shapes and, fused, model and fused shapes) emits
    plain greedy output for 8 prompts in ``batch`` slots, sequences joining as others finish."""
    drafter, options = _variant(variant, models, datastore)
    offer = device_offer(create_drafter(drafter, **options), DEFAULT_BUDGET)
    engine = Engine(targets["mamba2"], offer.drafter, offer.shapes, max_batch=batch, max_seqlen=256, goodput=True)
    prompts = _prompts(8)
    reqs = engine.run([Request(p, max_new_tokens=NEW - 2 * (i % 3)) for i, p in enumerate(prompts)])
    for r, ref, i in zip(reqs, plain("mamba2", 8), range(8)):
        assert r.output == ref[: NEW - 2 * (i % 3)]
    ran = {k[len("steps:"):] for k, v in engine.metrics.items() if k.startswith("steps:") and v}
    assert "none" in ran and any(s.startswith(("lookup:", "fused:")) for s in ran), ran
    assert engine.goodput is not None and len(engine.goodput.table()) == len(offer.shapes)
