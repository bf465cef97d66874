"""GPU: for one tiny model per supported checkpoint family (transformers' classes and MambaInLlama), the Triton
kernel path equals the reference path (fp32 greedy)."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.kernels import backend
from stree.protocols.token_tree import TokenTree
from stree.verifier.model.checkpoint import load_model
from hf_helpers import BUILDERS, DRAFTS, build_tiny, save_tiny, tiny_pair

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(name: str, dirs, kernels: str):
    backend.use(kernels)
    try:
        model = load_model(dirs["target"], device="cuda", dtype=torch.float32)
        draft = load_model(dirs["draft"], device="cuda", dtype=torch.float32)
        prompt = list(range(3, 11))
        tree = TokenTree.from_parents([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2])
        scores = model.score_tree(prompt, tree).cpu()
        outs = [stree.generate(model, prompt, drafter="mamba", draft_model=draft, max_new_tokens=16, tree=t,
                               cuda_graphs=graphs).token_ids
                for t in ("chain:4", "static:2,2,1", "beam:3x2") for graphs in (False, True)]
        return scores, outs
    finally:
        backend.use(None)


@pytest.mark.parametrize("name", sorted(BUILDERS) + ["mamba2", "mambainllama"])
def test_triton_path_equals_reference_path(name, tmp_path):
    dirs = tiny_pair(name, tmp_path)
    ref_scores, ref_outs = _run(name, dirs, "torch")
    tri_scores, tri_outs = _run(name, dirs, "triton")
    torch.testing.assert_close(tri_scores, ref_scores, atol=2e-3, rtol=2e-3)
    # transformers' own greedy is the CPU suite's check (tests/verifier/test_hf_families.py): here its
    # causal-conv1d fast path refuses these tiny shapes (strides not multiples of 8) on the GPU
    assert all(out == ref_outs[0] for out in ref_outs + tri_outs)


# options the loaders read since they follow transformers field by field: projection and MLP biases (random here),
# NemotronH's latent experts, GraniteMoeHybrid heads of another width than hidden_size / heads
OPTIONS = {"nemotron_h": dict(use_bias=True, mlp_bias=True, moe_latent_size=16),
           "granitemoehybrid": dict(head_dim=16, attention_bias=True, mamba_proj_bias=True),
           "zamba2": dict(add_bias_linear=True), "bamba": dict(mlp_bias=True, attention_bias=True)}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_triton_path_equals_reference_path_with_biases_latent_experts_and_head_dim(name, tmp_path):
    over = OPTIONS[name]
    dirs = {"target": save_tiny(build_tiny(name, random_biases=True, **over), tmp_path / "t"),
            "draft": save_tiny(build_tiny(name, random_biases=True, **{**over, **DRAFTS[name]}), tmp_path / "d")}
    ref_scores, ref_outs = _run(name, dirs, "torch")
    tri_scores, tri_outs = _run(name, dirs, "triton")
    torch.testing.assert_close(tri_scores, ref_scores, atol=2e-3, rtol=2e-3)
    assert all(out == ref_outs[0] for out in ref_outs + tri_outs)
