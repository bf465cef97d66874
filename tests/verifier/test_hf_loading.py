"""Loading Hugging Face folders: refused config values, sharded weights, torch_dtype, EOS and tokenizer settings."""

from __future__ import annotations

import json

import pytest
import torch

import stree
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.generation_settings import load_generation_settings
from stree.verifier.model.tokenizer import char_tokenizer
from hf_helpers import hf_logits, mamba2_tiny, save_tiny

transformers = pytest.importorskip("transformers")
V = 64


def _edit_config(folder, **fields):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def test_mamba2_mixer_norm_eps_comes_from_the_config(tmp_path):
    hf = mamba2_tiny()
    model = load_model(save_tiny(hf, tmp_path))
    ids = torch.randint(0, V, (9,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("model_type", "jamba", "JambaForCausalLM is not supported"),
    ("torch_dtype", "int8", "torch_dtype 'int8'"),
])
def test_refused_values_name_the_field(tmp_path, field, value, message):
    save_tiny(mamba2_tiny(), tmp_path)
    extra = {"architectures": ["JambaForCausalLM"]} if field == "model_type" else {}
    _edit_config(tmp_path, **{field: value}, **extra)
    if field == "torch_dtype":
        _edit_config(tmp_path, dtype=value)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


@pytest.mark.parametrize("field,value", [("mlp_bias", True), ("hidden_act", "relu"),
                                         ("rope_parameters", {"rope_type": "yarn", "factor": 2.0})])
def test_bamba_refusals(tmp_path, field, value):
    cfg = transformers.BambaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, mamba_n_heads=4, mamba_d_state=8)
    transformers.BambaForCausalLM(cfg).save_pretrained(str(tmp_path))
    _edit_config(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=field if field != "rope_parameters" else "rope_type='yarn'"):
        load_model(tmp_path)


def test_sharded_checkpoint_matches_unsharded_and_keeps_torch_dtype(tmp_path):
    hf = mamba2_tiny()
    whole = load_model(save_tiny(hf, tmp_path / "whole"))
    sharded = load_model(save_tiny(hf, tmp_path / "sharded", shard="10KB"))
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, V, (1, 8))
    torch.testing.assert_close(sharded(ids), whole(ids), rtol=0, atol=0)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    assert load_model(tmp_path / "bf16").dtype == torch.bfloat16
    assert load_model(tmp_path / "bf16", dtype=torch.float32).dtype == torch.float32


def test_missing_shard_is_named(tmp_path):
    save_tiny(mamba2_tiny(), tmp_path, shard="10KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(FileNotFoundError, match="shard .* is missing"):
        load_model(tmp_path)


def test_generation_config_eos_ids_stop_generation(tmp_path):
    hf = mamba2_tiny()
    save_tiny(hf, tmp_path)
    model = load_model(tmp_path)
    prompt = [3, 4, 5]
    free = stree.generate(model, prompt, max_new_tokens=8, cuda_graphs=False).token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [63, free[2]]}))
    settings = load_generation_settings(tmp_path)
    assert settings.eos_token_ids == [63, free[2]]
    out = stree.generate(model, prompt, max_new_tokens=8, stop_token_ids=settings.eos_token_ids, cuda_graphs=False)
    assert out.token_ids == free[: free.index(free[2]) + 1]


def test_tokenizer_config_special_tokens_chat_template_and_tokenizer_dir(tmp_path):
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tok"
    save_tiny(mamba2_tiny(), model_dir)
    (model_dir / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((model_dir / "config.json").read_text()).items() if k != "eos_token_id"}))
    (model_dir / "generation_config.json").unlink()
    tok_dir.mkdir()
    char_tokenizer(V).save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "!", "special": True}, "bos_token": "#",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}",
    }))
    settings = load_generation_settings(model_dir, tokenizer_dir=tok_dir)
    assert settings.tokenizer is not None
    assert settings.eos_token_ids == [settings.tokenizer.token_to_id("!")]
    bos = json.loads((model_dir / "config.json").read_text())["bos_token_id"]
    assert settings.bos_token_id == bos  # config.json's id wins over tokenizer_config's text
    assert settings.render_chat([{"role": "user", "content": "hi"}]) == "user: hi!"
    with pytest.raises(FileNotFoundError, match="tokenizer directory"):
        load_generation_settings(model_dir, tokenizer_dir=tmp_path / "nowhere")


def _config_dict(cls_name: str, **kw) -> dict:
    return getattr(transformers, cls_name)(**kw).to_dict()


@pytest.mark.parametrize("cls_name,kw,edit,message", [
    ("NemotronHConfig", {}, {"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
    ("NemotronHConfig", {}, {"mamba_hidden_act": "relu"}, "mamba_hidden_act='relu'"),
    ("NemotronHConfig", {}, {"moe_latent_size": 16}, "moe_latent_size=16"),
    ("GraniteMoeHybridConfig", {}, {"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
    ("GraniteMoeHybridConfig", {}, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("BambaConfig", {}, {"mamba_d_head": 7}, "mamba_n_heads\\*mamba_d_head"),
    ("FalconH1Config", {}, {"mlp_bias": True}, "mlp_bias=True"),
    ("FalconH1Config", {}, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("FalconH1Config", {}, {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ("FalconH1Config", {}, {"mamba_d_head": 7}, "mamba_n_heads\\*mamba_d_head"),
    ("FalconH1Config", {}, {"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers=\\[1.0, 2.0\\] must hold 5"),
    ("FalconH1Config", {}, {"mlp_multipliers": [1.0]}, "mlp_multipliers=\\[1.0\\] must hold 2"),
    ("Zamba2Config", {}, {"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
    ("Zamba2Config", {}, {"add_bias_linear": True}, "add_bias_linear=True"),
    ("Zamba2Config", {}, {"use_mem_rope": True, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
     "rope_type='yarn'"),
    ("Zamba2Config", {}, {"layers_block_type": ["mamba", "attention"]}, "layers_block_type entries \\['attention'\\]"),
    ("Zamba2Config", {"num_key_value_heads": 8}, {"use_shared_attention_adapter": True},
     "num_key_value_heads=8 with use_shared_attention_adapter"),
    ("Zamba2Config", {}, {"n_mamba_heads": 7}, "n_mamba_heads=7"),
    ("Zamba2Config", {}, {"num_attention_heads": 3}, "num_attention_heads=3"),
    ("JambaConfig", {}, {"architectures": ["JambaForCausalLM"]}, "JambaForCausalLM is not supported"),
])
def test_each_family_refuses_what_it_cannot_compute(cls_name, kw, edit, message):
    from stree.verifier.model.hf.registry import resolve

    data = {**_config_dict(cls_name, **kw), **edit}
    with pytest.raises(ValueError, match=message):
        resolve(json.loads(json.dumps(data, default=float)))


def test_granite_without_experts_runs_the_shared_mlp_alone(tmp_path):
    from hf_helpers import BUILDERS, check_scores

    hf = BUILDERS["granitemoehybrid"](num_local_experts=0, num_hidden_layers=2, layer_types=["mamba", "attention"])
    check_scores(load_model(save_tiny(hf, tmp_path)), hf, V)


@pytest.mark.parametrize("over", [
    dict(mamba_rms_norm=False),  # transformers' default: y * silu(z), no gated norm
    dict(mamba_norm_before_gate=False),
    dict(projectors_bias=True, attention_bias=True),  # Mamba out_proj has a bias, in_proj none
    dict(mamba_proj_bias=True, mamba_d_ssm=None, mamba_n_heads=8, head_dim=16, tie_word_embeddings=True),
])
def test_falcon_h1_variants_match_transformers(tmp_path, over):
    from hf_helpers import BUILDERS, check_scores

    hf = BUILDERS["falcon_h1"](**over)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    check_scores(load_model(save_tiny(hf, tmp_path)), hf, V)


def test_falcon_h1_round_trips_through_save_model(tmp_path):
    from hf_helpers import BUILDERS
    from stree.verifier.model.checkpoint import save_model

    model = load_model(save_tiny(BUILDERS["falcon_h1"](num_hidden_layers=1), tmp_path / "hf"))
    again = load_model(save_model(model, tmp_path / "stree"))
    assert again.config.to_dict() == model.config.to_dict() and again.config.parallel_mamba
    ids = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("over", [
    dict(use_shared_attention_adapter=False, use_mem_rope=False, hidden_act="silu", num_key_value_heads=2),
    dict(num_mem_blocks=1, tie_word_embeddings=False, layers_block_type=["hybrid", "mamba", "hybrid"]),
])
def test_zamba2_variants_match_transformers(tmp_path, over):
    from hf_helpers import BUILDERS, check_scores

    hf = BUILDERS["zamba2"](**over)
    check_scores(load_model(save_tiny(hf, tmp_path)), hf, V)


def test_zamba2_round_trips_through_save_model(tmp_path):
    from hf_helpers import BUILDERS
    from stree.verifier.model.checkpoint import save_model

    model = load_model(save_tiny(BUILDERS["zamba2"](), tmp_path / "hf"))
    again = load_model(save_model(model, tmp_path / "stree"))
    assert again.config.to_dict() == model.config.to_dict() and again.config.hybrid_layer_idx == [1, 3, 4]
    ids = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)
