"""Beam drafts by M-row decode steps on scratch states (``DeviceTreeDrafter.beam_steps``) against tree passes.

The steps must lay out the tree the tree passes lay out (same tokens, same parents, greedy and sampled rows),
leave the same commit activations, never touch the slots' state before the commit, and keep one pair of scratch
states per beam width (a captured graph holds their memory). Hybrid draft models keep the tree passes.
"""

from __future__ import annotations

import pytest
import torch
from device_draft_helpers import prefilled_drafter, states_close

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels import backend
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape


def _paths(parents: torch.Tensor, gen: torch.Generator):
    """A random root-to-node path per row of a beam tree (``parents`` [B, N]) and its length."""
    b, n = parents.shape
    paths = torch.zeros(b, n, dtype=torch.long)
    lens = torch.zeros(b, dtype=torch.long)
    for row in range(b):
        node, walk = int(torch.randint(0, n, (1,), generator=gen)), []
        while node >= 0:
            walk.append(node)
            node = int(parents[row, node])
        walk.reverse()
        paths[row, : len(walk)] = torch.tensor(walk)
        lens[row] = len(walk)
    return paths, lens


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("tree", ["beam:1x2", "beam:3x2", "beam:4x3"])
def test_beam_by_steps_drafts_and_commits_what_tree_passes_do(models, kernels, tree):
    model = models["draft"]
    gen = torch.Generator().manual_seed(len(tree))
    contexts = [torch.randint(0, model.vocab_size, (k,), generator=gen) for k in (3, 9, 1)]
    backend.use(kernels)
    try:
        steps = prefilled_drafter(model, contexts, beam_steps=True)
        trees = prefilled_drafter(model, contexts, beam_steps=False)
        assert steps.beam_steps and not trees.beam_steps
        before = steps.state.clone()
        shape = TreeShape.parse(tree)
        greedy = RowSampling.greedy(3, torch.device("cpu"))
        for _ in range(2):  # the second draft reuses the scratch and starts from the slots again
            roots = torch.randint(0, model.vocab_size, (3,), generator=gen)
            a = steps.draft(shape, roots, greedy, False)
            b = trees.draft(shape, roots, greedy, False)
            states_close(steps.state, before)  # drafting changed nothing the slots hold
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            states_close(steps.acts, trees.acts)
        assert list(steps.beam_scratch) == [shape.beams]
        path, path_len = _paths(a.parents, gen)
        steps.commit(path, path_len)
        trees.commit(path, path_len)
        states_close(steps.state, trees.state)
    finally:
        backend.use(None)


def test_sampled_rows_score_beams_by_the_warped_law(models):
    """Row 0 greedy, row 1 sampled at T=0.7 with top-k 5: both layouts agree, and the sampled row's beams stay
    inside its top-k (a beam score is the log of the warped law, -inf outside it)."""
    model = models["draft"]
    gen = torch.Generator().manual_seed(7)
    contexts = [torch.randint(0, model.vocab_size, (k,), generator=gen) for k in (4, 6)]
    steps = prefilled_drafter(model, contexts, beam_steps=True)
    trees = prefilled_drafter(model, contexts, beam_steps=False)
    sampling = RowSampling(torch.tensor([0.0, 0.7]), torch.tensor([0, 5]), torch.ones(2))
    roots = torch.randint(0, model.vocab_size, (2,), generator=gen)
    shape = TreeShape.parse("beam:3x3")
    a = steps.draft(shape, roots, sampling, True)
    b = trees.draft(shape, roots, sampling, True)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    logits, _ = trees._logits(a.tokens, a.parents)
    top5 = logits[1, 0].topk(5).indices
    assert set(a.tokens[1, 1:4].tolist()) <= set(top5.tolist())  # the root's children of the sampled row


def test_beam_widths_keep_their_own_scratch(models):
    """Switching widths keeps each width's scratch (a graph captured on one must never see it freed)."""
    model = models["draft"]
    drafter = prefilled_drafter(model, [torch.tensor([1, 2, 3]), torch.tensor([4])], beam_steps=True)
    greedy = RowSampling.greedy(2, torch.device("cpu"))
    roots = torch.tensor([5, 6])
    drafter.draft(TreeShape.parse("beam:2x2"), roots, greedy, False)
    first = drafter.beam_scratch[2][0]
    drafter.draft(TreeShape.parse("beam:2x3"), roots, greedy, False)
    drafter.draft(TreeShape.parse("beam:3x2"), roots, greedy, False)
    assert drafter.beam_scratch[2][0] is first and set(drafter.beam_scratch) == {2, 3}
    assert [st.batch_size for st in drafter.beam_scratch[3][0]] == [6, 6]


def test_hybrid_draft_models_keep_tree_passes_for_beams(models):
    drafter = DeviceTreeDrafter(models["hybrid"], beam_steps=True)
    assert not drafter.beam_steps


def test_pure_mamba2_draft_models_draft_beams_by_steps_by_default(models):
    assert DeviceTreeDrafter(models["draft"]).beam_steps
    assert not DeviceTreeDrafter(models["draft"], beam_steps=False).beam_steps
