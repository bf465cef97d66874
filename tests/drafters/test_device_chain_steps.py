"""Chain drafts by one-token steps on a scratch state (``DeviceTreeDrafter.chain_steps``) against tree passes.

The steps must pick what the tree passes pick, record the law each pick came from at the right node, leave
the same commit activations (so the committed draft state is the same), and never touch the slots' state
before the commit. Hybrid draft models keep the tree passes (their KV cache is too big to copy per draft).
"""

from __future__ import annotations

import pytest
import torch
from device_draft_helpers import prefilled_drafter, states_close

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape
from stree.kernels import backend



@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("depth", [1, 4])
def test_chain_by_steps_drafts_and_commits_what_tree_passes_do(models, kernels, depth):
    model = models["draft"]
    gen = torch.Generator().manual_seed(depth)
    contexts = [torch.randint(0, model.vocab_size, (k,), generator=gen) for k in (3, 9, 1)]
    backend.use(kernels)
    try:
        steps = prefilled_drafter(model, contexts, chain_steps=True)
        trees = prefilled_drafter(model, contexts, chain_steps=False)
        assert steps.chain_steps and not trees.chain_steps
        before = steps.state.clone()
        roots = torch.randint(0, model.vocab_size, (3,), generator=gen)
        shape = TreeShape.parse(f"chain:{depth}")
        greedy = RowSampling.greedy(3, roots.device)
        a = steps.draft(shape, roots, greedy, False)
        b = trees.draft(shape, roots, greedy, False)
        states_close(steps.state, before)  # drafting changed nothing the slots hold
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        for xa, xb in zip(steps.acts.layers, trees.acts.layers):
            for name in vars(xa):
                torch.testing.assert_close(getattr(xa, name), getattr(xb, name), atol=1e-5, rtol=1e-5)
        path = torch.arange(depth + 1).expand(3, -1).contiguous()
        path_len = torch.tensor([1, depth + 1, max(1, depth)])
        steps.commit(path, path_len)
        trees.commit(path, path_len)
        states_close(steps.state, trees.state)
    finally:
        backend.use(None)


def test_sampled_chain_by_steps_records_each_picks_law(models):
    """Row 0 greedy, row 1 sampled: q[:, d] is the warped law after node d, and every pick has mass under it."""
    model = models["draft"]
    gen = torch.Generator().manual_seed(3)
    contexts = [torch.randint(0, model.vocab_size, (k,), generator=gen) for k in (5, 2)]
    steps = prefilled_drafter(model, contexts, chain_steps=True)
    trees = prefilled_drafter(model, contexts, chain_steps=False)
    sampling = RowSampling(torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long), torch.ones(2))
    roots = torch.randint(0, model.vocab_size, (2,), generator=gen)
    shape = TreeShape.parse("chain:3")
    draft = steps.draft(shape, roots, sampling, True)
    trees._set_shape(shape)
    logits, _ = trees._logits(draft.tokens, draft.parents)  # every node's law, scored along the drafted chain
    want = sampling.warp(logits)
    torch.testing.assert_close(draft.q[:, :3], want[:, :3], atol=1e-5, rtol=1e-5)
    assert torch.equal(draft.q[:, 3], torch.zeros_like(draft.q[:, 3]))  # a leaf has no children to draw
    picked = draft.q[:, :3].gather(2, draft.tokens[:, 1:, None])[..., 0]
    assert bool((picked > 0).all())
    assert torch.equal(draft.tokens[0, 1:], logits[0, :3].argmax(-1))  # the greedy row takes the argmax


def test_hybrid_draft_models_keep_tree_passes(models):
    drafter = DeviceTreeDrafter(models["hybrid"], chain_steps=True)
    drafter.new_slots(2, 32)
    assert not drafter.chain_steps and drafter.scratch is None


def test_pure_mamba2_draft_models_draft_chains_by_steps_by_default(models):
    assert DeviceTreeDrafter(models["draft"]).chain_steps
    assert not DeviceTreeDrafter(models["draft"], chain_steps=False).chain_steps
