"""Loading Hugging Face folders: configs as transformers reads them (legacy names, keys it ignores, unknown keys),
every checkpoint tensor loaded, proven equal or named, sharded weights, torch_dtype, EOS and tokenizer settings.

Each config field of each family is walked in ``test_hf_config_fields.py``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import stree
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.generation_settings import load_generation_settings
from stree.verifier.model.hf.fields import CheckpointWarning
from stree.verifier.model.tokenizer import char_tokenizer
from hf_helpers import build_tiny, hf_logits, mamba2_tiny, save_tiny

transformers = pytest.importorskip("transformers")
V = 64


def _edit_config(folder, **fields):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _rewrite_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path), metadata={"format": "pt"})


def _assert_matches(model, hf, atol=1e-5):
    ids = torch.randint(0, hf.config.vocab_size, (11,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), hf_logits(hf, ids), atol=atol, rtol=atol)


def _quiet_load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        return load_model(folder)


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "jamba", "JambaForCausalLM is not supported"),
    ("torch_dtype", "int8", "torch_dtype 'int8'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config is not supported"),
])
def test_refused_values_name_the_field(tmp_path, field, value, message):
    save_tiny(mamba2_tiny(), tmp_path)
    extra = {"architectures": ["JambaForCausalLM"]} if field == "model_type" else {}
    _edit_config(tmp_path, **{field: value}, **extra)
    if field == "torch_dtype":
        _edit_config(tmp_path, dtype=value)
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path)


def test_mamba2_keys_transformers_ignores_are_ignored(tmp_path):
    """Older Mamba2 configs' rms_norm / norm_before_gate: transformers runs the gated norm whatever they say."""
    hf = mamba2_tiny()
    save_tiny(hf, tmp_path)
    _edit_config(tmp_path, rms_norm=False, norm_before_gate=True, time_step_scale=1.0)
    _assert_matches(_quiet_load(tmp_path), hf)


def test_unknown_config_keys_are_named_in_a_warning(tmp_path):
    hf = mamba2_tiny()
    save_tiny(hf, tmp_path)
    _edit_config(tmp_path, mamba_future_option=3)
    with pytest.warns(CheckpointWarning, match=r"\['mamba_future_option'\] is not a field of .*Mamba2Config"):
        model = load_model(tmp_path)
    _assert_matches(model, hf)


def test_nemotron_h_legacy_names_read_as_transformers_reads_them(tmp_path):
    """``mamba_n_groups`` & co. and ``hybrid_override_pattern``, as NemotronHConfig.__post_init__ maps them."""
    hf = build_tiny("nemotron_h", n_groups=4, conv_kernel=3, chunk_size=8, layers_block_type=["mamba", "moe",
                                                                                            "attention", "mlp"])
    save_tiny(hf, tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    for old, new in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"),
                     ("mamba_chunk_size", "chunk_size")):
        data[old] = data.pop(new)
    data["hybrid_override_pattern"] = "ME*-"
    del data["layers_block_type"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert transformers.AutoConfig.from_pretrained(str(tmp_path)).n_groups == 4
    _assert_matches(_quiet_load(tmp_path), hf)


def test_legacy_rope_keys_and_bamba_forced_partial_rotary(tmp_path):
    """Top-level ``rope_theta`` folds into ``rope_parameters``; Bamba's class puts 0.5 over a top-level
    ``partial_rotary_factor``; Granite rotates the whole head whatever the factor says."""
    for family, top in (("bamba", {"partial_rotary_factor": 1.0}), ("granitemoehybrid", {})):
        hf = build_tiny(family, rope_parameters={"rope_type": "default", "rope_theta": 300.0, **top})
        folder = save_tiny(hf, tmp_path / family)
        data = json.loads((folder / "config.json").read_text())
        data["rope_parameters"] = None
        data.update(rope_theta=300.0, **top)
        (folder / "config.json").write_text(json.dumps(data))
        again = getattr(transformers, type(hf).__name__).from_pretrained(str(folder)).eval()
        _assert_matches(_quiet_load(folder), again)


def test_tied_head_equal_to_the_embedding_loads_quietly_and_a_different_one_untied(tmp_path):
    """transformers loads a saved lm_head.weight that differs from the embedding untied (with a warning); so
    does stree, naming it; an equal one is the same tensor either way."""
    hf = mamba2_tiny(tie_word_embeddings=True)
    save_tiny(hf, tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.__setitem__("lm_head.weight", sd["backbone.embeddings.weight"].clone()))
    model = _quiet_load(tmp_path)
    assert model.lm_head.weight is model.backbone.embedding.weight
    _assert_matches(model, hf)
    _rewrite_weights(tmp_path, lambda sd: sd.__setitem__("lm_head.weight", torch.randn_like(sd["lm_head.weight"])))
    again = transformers.Mamba2ForCausalLM.from_pretrained(str(tmp_path)).eval()
    with pytest.warns(CheckpointWarning, match="lm_head.weight differs"):
        model = load_model(tmp_path)
    assert not model.config.tie_embeddings
    _assert_matches(model, again)


@pytest.mark.parametrize("layers", [["mlp"], ["mamba", "moe", "attention", "mlp"], ["attention", "moe", "mamba"]])
def test_nemotron_h_never_ties_its_head(tmp_path, layers):
    """tie_word_embeddings=True: transformers' NemotronH still runs its own saved lm_head.weight."""
    hf = build_tiny("nemotron_h", tie_word_embeddings=True, layers_block_type=layers, vocab_size=48, hidden_size=16,
                    mamba_num_heads=4, n_groups=4)
    _assert_matches(_quiet_load(save_tiny(hf, tmp_path)), hf)


def test_nemotron_h_multi_token_prediction_weights_are_named(tmp_path):
    hf = build_tiny("nemotron_h")
    save_tiny(hf, tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"mtp.layers.0.norm.weight": torch.ones(32)}))
    with pytest.warns(CheckpointWarning, match="mtp.layers.0.norm.weight .*multi-token prediction"):
        model = load_model(tmp_path)
    _assert_matches(model, hf)


def test_unexpected_tensor_is_refused_by_name(tmp_path):
    save_tiny(build_tiny("granitemoehybrid"), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"model.layers.0.mystery.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="unexpected 1 tensors .*model.layers.0.mystery.weight"):
        load_model(tmp_path)


def test_falcon_h1_saved_mup_vectors_are_checked_against_the_config(tmp_path):
    """Older releases saved each layer's mup vector; transformers recomputes it from ssm_multipliers. An equal one
    loads quietly, a different one is named (and, as in transformers, not used)."""
    from stree.verifier.model.hf.falcon_h1 import SPEC, _mup_vector

    hf = build_tiny("falcon_h1")
    save_tiny(hf, tmp_path)
    mup = _mup_vector(SPEC.read(json.loads((tmp_path / "config.json").read_text())))
    _rewrite_weights(tmp_path, lambda sd: sd.update({"model.layers.0.mamba.mup_vector": mup[None, None].clone()}))
    _assert_matches(_quiet_load(tmp_path), hf)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"model.layers.1.mamba.mup_vector": 2 * mup[None, None]}))
    with pytest.warns(CheckpointWarning, match="model.layers.1.mamba.mup_vector"):
        _assert_matches(load_model(tmp_path), hf)


def test_zamba2_saved_copy_of_a_tied_block_runs_as_transformers_runs_it(tmp_path):
    """A later hybrid layer's own copy of a tied shared block, saved with other values: transformers leaves that
    tensor untied and runs it; so does stree. Layer 4 reuses layer 1's block (num_mem_blocks=2)."""
    save_tiny(build_tiny("zamba2"), tmp_path)
    g = torch.Generator().manual_seed(5)

    def add_copy(sd):
        for rel in ("self_attn.q_proj.weight", "feed_forward.down_proj.weight", "input_layernorm.weight"):
            t = sd[f"model.layers.1.shared_transformer.{rel}"]
            sd[f"model.layers.4.shared_transformer.{rel}"] = t + 0.1 * torch.randn(t.shape, generator=g)
    _rewrite_weights(tmp_path, add_copy)
    hf = transformers.Zamba2ForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert not torch.equal(hf.model.layers[4].shared_transformer.self_attn.q_proj.weight,
                           hf.model.layers[1].shared_transformer.self_attn.q_proj.weight)
    _assert_matches(_quiet_load(tmp_path), hf)


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


def test_falcon_h1_round_trips_through_save_model(tmp_path):
    from hf_helpers import BUILDERS
    from stree.verifier.model.checkpoint import save_model

    model = load_model(save_tiny(BUILDERS["falcon_h1"](num_hidden_layers=1), tmp_path / "hf"))
    again = load_model(save_model(model, tmp_path / "stree"))
    assert again.config.to_dict() == model.config.to_dict() and again.config.parallel_mamba
    ids = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)


def test_zamba2_round_trips_through_save_model(tmp_path):
    from hf_helpers import BUILDERS
    from stree.verifier.model.checkpoint import save_model

    model = load_model(save_tiny(BUILDERS["zamba2"](), tmp_path / "hf"))
    again = load_model(save_model(model, tmp_path / "stree"))
    assert again.config.to_dict() == model.config.to_dict() and again.config.hybrid_layer_idx == [1, 3, 4]
    ids = torch.randint(0, V, (1, 9))
    torch.testing.assert_close(again(ids), model(ids), rtol=0, atol=0)
