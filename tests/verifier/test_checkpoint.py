"""Checkpoints: mamba_ssm format round trips, Hugging Face Mamba2 checkpoints, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
import torch

import stree
from stree.verifier.model.checkpoint import init_model, load_model


def test_mamba_ssm_format_round_trip_in_both_weight_formats(tmp_path):
    a = load_model(init_model(tmp_path / "st", arch="hybrid", d_model=32, n_layer=2, attn_layers=[1],
                              vocab_size=100, d_state=8, headdim=8, seed=5, d_intermediate=40))
    b = load_model(init_model(tmp_path / "pt", arch="hybrid", d_model=32, n_layer=2, attn_layers=[1],
                              vocab_size=100, d_state=8, headdim=8, seed=5, d_intermediate=40, fmt="bin"))
    ids = torch.randint(0, 100, (1, 12))
    torch.testing.assert_close(a(ids), b(ids))
    cfg = json.loads((tmp_path / "st" / "config.json").read_text())
    assert {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
            "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple",
            "tie_embeddings"} <= set(cfg)
    assert cfg["ssm_cfg"]["layer"] == "Mamba2" and cfg["attn_layer_idx"] == [1]
    assert (tmp_path / "st" / "tokenizer.json").exists()


def test_parameter_names_are_mamba_ssms(tmp_path):
    from safetensors import safe_open

    init_model(tmp_path, arch="hybrid", d_model=32, n_layer=2, attn_layers=[1], vocab_size=64, d_state=8,
               headdim=8, d_intermediate=64)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        "backbone.embedding.weight", "backbone.norm_f.weight",
        "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.0.mixer.conv1d.weight", "backbone.layers.0.mixer.conv1d.bias",
        "backbone.layers.0.mixer.dt_bias", "backbone.layers.0.mixer.A_log", "backbone.layers.0.mixer.D",
        "backbone.layers.0.mixer.norm.weight", "backbone.layers.0.mixer.out_proj.weight",
        "backbone.layers.0.norm2.weight", "backbone.layers.0.mlp.fc1.weight", "backbone.layers.0.mlp.fc2.weight",
        "backbone.layers.1.mixer.in_proj.weight", "backbone.layers.1.mixer.in_proj.bias",
        "backbone.layers.1.mixer.out_proj.weight", "backbone.layers.1.mixer.out_proj.bias",
    } <= names
    assert "lm_head.weight" not in names  # tied to the embedding, as in mamba_ssm


def test_hugging_face_mamba2_checkpoint_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Mamba2Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=8,
        num_heads=8, n_groups=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.backbone.layers:  # non-trivial D, dt and norm weights
            layer.mixer.D.uniform_(0.5, 1.5)
            layer.mixer.dt_bias.uniform_(-3, 0)
            layer.mixer.norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=1e-4)
    assert ours.config.ssm["ngroups"] == 2


def _ckpt(tmp_path, name="m"):
    return init_model(tmp_path / name, d_model=16, n_layer=1, vocab_size=32, d_state=8, headdim=8)


def test_missing_checkpoint_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda d: (d / "config.json").write_text("{not json"), ValueError, r"config\.json: not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError,
         "no model.safetensors, model.safetensors.index.json or pytorch_model.bin"),
        (lambda d: _truncate(d / "model.safetensors"), ValueError, r"model\.safetensors: cannot read"),
        (lambda d: (d / "config.json").unlink(), FileNotFoundError, "no config.json"),
    ],
)
def test_missing_and_unreadable_files_name_the_file(tmp_path, damage, error, message):
    d = _ckpt(tmp_path)
    damage(d)
    with pytest.raises(error, match=message):
        load_model(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"d_model": 24}, "has shape"),
        ({"n_layer": 2}, "missing"),
        ({"ssm_cfg": {"layer": "Mamba1"}}, "only 'Mamba2'"),
        ({"attn_layer_idx": [5]}, "outside 0..0"),
        ({"vocab_size": -3}, "positive integer"),
        ({"ssm_cfg": {"layer": "Mamba2", "d_state": 8, "headdim": 8, "bogus": 1}}, "unknown ssm_cfg keys"),
    ],
)
def test_config_that_does_not_match_the_weights(tmp_path, change, message):
    d = _ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(d)


def test_weights_with_nan_or_extra_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _ckpt(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    sd["backbone.layers.0.mixer.D"][0] = float("nan")
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="contains NaN"):
        load_model(d)
    d = _ckpt(tmp_path, "x")
    sd = load_file(str(d / "model.safetensors"))
    sd["backbone.layers.7.mixer.D"] = torch.ones(4)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected 1 tensors"):
        load_model(d)


def test_load_model_dtype_and_api(tmp_path):
    m = stree.load_model(_ckpt(tmp_path), device="cpu", dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    out = m.score_sequence(torch.tensor([1, 2, 3]))
    assert out.shape == (3, 32) and out.dtype == torch.float32
