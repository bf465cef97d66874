"""The device-side beam search (the one CUDA graphs capture) equals a plain beam search over score_sequence."""

from __future__ import annotations

import pytest
import torch

from stree import DraftBudget, SamplingParams
from stree.drafter_service.drafters.mamba.drafter import MambaDrafter


def reference_beam(model, context, depth, beams):
    seqs, out = [([], 0.0)], []
    for _ in range(depth):
        cand = []
        for seq, score in seqs:
            logp = torch.log_softmax(model.score_sequence(torch.tensor(context + seq))[-1], -1)
            cand += [(seq + [t], score + float(logp[t])) for t in range(model.vocab_size)]
        seqs = sorted(cand, key=lambda c: -c[1])[:beams]
        out += [tuple(s) for s, _ in seqs]
    return set(out)


@pytest.mark.parametrize("depth, beams", [(1, 3), (3, 2), (4, 3)])
def test_beam_tree_holds_every_beam_prefix(models, depth, beams):
    draft = models["draft"]
    context = [5, 9, 13, 2]
    session = MambaDrafter(draft, f"beam:{depth}x{beams}").open(context, SamplingParams())
    tree = session.draft(DraftBudget(max_nodes=64, max_depth=8, max_width=8))
    got = {tuple(tree.path_tokens(i)[1:]) for i in range(1, tree.num_nodes)}
    assert got == reference_beam(draft, context, depth, beams)
    assert tree.num_nodes == 1 + depth * beams


def test_beam_tree_respects_budget(models):
    session = MambaDrafter(models["draft"], "beam:5x4").open([1, 2], SamplingParams())
    tree = session.draft(DraftBudget(max_nodes=7, max_depth=3, max_width=2))
    assert tree.num_nodes <= 7 and tree.max_depth <= 3
    assert max(len(k) for k in tree.children()) <= 2
