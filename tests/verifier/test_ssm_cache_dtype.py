"""``mamba_ssm_cache_dtype``: a half-precision SSM state (as mamba_ssm keeps it) behind the same kernels."""

from __future__ import annotations

import pytest
import torch
from stree.verifier.model.layer_stack import field_stacks

from stree import TokenTree, TreeBatch


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_half_state_tracks_the_float32_state(models, arch):
    model = models[arch]
    ids = torch.randint(0, model.vocab_size, (2, 9))
    tree = TreeBatch.from_trees([TokenTree([1, 2, 3], [-1, 0, 0]), TokenTree([4, 5, 6], [-1, 0, 1])])
    path, path_len = torch.tensor([[0, 2, 0], [0, 1, 2]]), torch.tensor([2, 3])
    results = {}
    try:
        for name in ("float32", "bfloat16"):
            model.set_mamba_ssm_cache_dtype(name)
            state = model.new_state(2, 32)
            model.prefill(ids, state)
            step_logits = model.step(ids[:, -1], state)
            tree_logits, acts = model.tree_forward(tree, state)
            model.commit(state, acts, path, path_len)
            ssm = [layer.ssm_state for layer in state.layers if hasattr(layer, "ssm_state")]
            assert {t.dtype for t in ssm} == {getattr(torch, name)}
            assert {n: v is not None for n, _, v in field_stacks(state.layers)}["ssm_state"]
            results[name] = (step_logits, tree_logits, torch.stack([t.float() for t in ssm]))
    finally:
        model.set_mamba_ssm_cache_dtype("float32")
    for full, half in zip(results["float32"], results["bfloat16"]):
        assert (half - full).abs().max() <= 2e-2 * full.abs().max() + 1e-3
    assert not torch.equal(results["float32"][2], results["bfloat16"][2])  # the state really was rounded


def test_auto_follows_the_model_and_bad_names_are_refused(models):
    model = models["mamba2"]
    try:
        model.set_mamba_ssm_cache_dtype("auto")
        assert model.mamba_ssm_cache_dtype == model.dtype
        with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
            model.set_mamba_ssm_cache_dtype("int8")
    finally:
        model.set_mamba_ssm_cache_dtype("float32")
