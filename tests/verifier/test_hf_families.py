"""Hugging Face hybrid classes loaded from transformers' own tiny random checkpoints match transformers exactly."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.verifier.model.checkpoint import load_model
from hf_helpers import check_scores, hf_greedy, perturb_, save_tiny

transformers = pytest.importorskip("transformers")
V = 64


def _bamba(**over):
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8,
              mamba_n_groups=2, mamba_chunk_size=16, rms_norm_eps=1e-2)
    kw.update(over)
    torch.manual_seed(0)
    hf = transformers.BambaForCausalLM(transformers.BambaConfig(**kw)).eval()
    perturb_(hf)
    return hf


BUILDERS = {"bamba": _bamba}


@pytest.fixture(params=sorted(BUILDERS))
def family(request, tmp_path):
    hf = BUILDERS[request.param]()
    return hf, load_model(save_tiny(hf, tmp_path / request.param, shard="20KB"))


def test_scores_match_transformers(family):
    hf, model = family
    check_scores(model, hf, V)


@pytest.mark.parametrize("tree", ["chain:4", "static:2,2,1", "beam:3x2"])
def test_greedy_speculation_equals_transformers_greedy(family, tmp_path, tree):
    hf, model = family
    draft = BUILDERS["bamba"](num_hidden_layers=1, attn_layer_indices=[])
    draft_model = load_model(save_tiny(draft, tmp_path / "draft"))
    prompt = torch.randint(0, V, (6,)).tolist()
    out = stree.generate(model, prompt, drafter="mamba", draft_model=draft_model, max_new_tokens=12, tree=tree,
                         cuda_graphs=False)
    assert out.token_ids == hf_greedy(hf, prompt, 12)
