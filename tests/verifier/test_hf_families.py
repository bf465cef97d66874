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


def _nemotron_h(**over):
    kw = dict(vocab_size=V, hidden_size=32, layers_block_type=["mamba", "moe", "attention", "mlp"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
              mamba_head_dim=8, ssm_state_size=8, n_groups=2, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=24, moe_shared_expert_intermediate_size=20, chunk_size=16,
              layer_norm_epsilon=1e-2, time_step_min=0.05, routed_scaling_factor=1.5)
    kw.update(over)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**kw)).eval()
    perturb_(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)
        for layer in hf.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return hf


def _granite(**over):
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=24, shared_intermediate_size=20, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
              mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16, num_local_experts=4,
              num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=3.0,
              residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5, rms_norm_eps=1e-2)
    kw.update(over)
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**kw)).eval()
    perturb_(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name or "router" in name:
                p.normal_(0, 0.2)
    return hf


BUILDERS = {"bamba": _bamba, "nemotron_h": _nemotron_h, "granitemoehybrid": _granite}
DRAFTS = {"bamba": dict(num_hidden_layers=1, attn_layer_indices=[]), "nemotron_h": dict(layers_block_type=["mamba"]),
          "granitemoehybrid": dict(num_hidden_layers=1, layer_types=["mamba"])}


@pytest.fixture(params=sorted(BUILDERS))
def family(request, tmp_path):
    hf = BUILDERS[request.param]()
    return request.param, hf, load_model(save_tiny(hf, tmp_path / request.param, shard="20KB"))


def test_scores_match_transformers(family):
    _, hf, model = family
    check_scores(model, hf, V)


@pytest.mark.parametrize("tree", ["chain:4", "static:2,2,1", "beam:3x2"])
def test_greedy_speculation_equals_transformers_greedy(family, tmp_path, tree):
    name, hf, model = family
    draft = BUILDERS[name](**DRAFTS[name])
    draft_model = load_model(save_tiny(draft, tmp_path / "draft"))
    prompt = torch.randint(0, V, (6,)).tolist()
    out = stree.generate(model, prompt, drafter="mamba", draft_model=draft_model, max_new_tokens=12, tree=tree,
                         cuda_graphs=False)
    assert out.token_ids == hf_greedy(hf, prompt, 12)
