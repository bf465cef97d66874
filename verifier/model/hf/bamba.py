"""Bamba (``BambaForCausalLM``): Mamba2 + GQA attention with partial RoPE, a SwiGLU MLP after every mixer.

The layout is mamba_ssm's (norm, mixer, norm2, gated MLP), so it maps onto ``ModelConfig`` directly.
"""

from __future__ import annotations

from stree.verifier.model.config import ModelConfig, require_silu
from stree.verifier.model.hf.common import hf_norm_fields, mamba_ssm_cfg, refuse_unless, rope_settings
from stree.verifier.model.hf.weights import fuse_attention, fuse_swiglu, layer_indices, mamba_layer_rules, rename

MODEL_TYPE = "bamba"
CLASS_NAME = "BambaForCausalLM"


def config(data: dict) -> ModelConfig:
    require_silu(data, "hidden_act")
    refuse_unless(data, "mlp_bias", False)
    d_model = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    head_dim = int(data.get("head_dim") or d_model // heads)
    eps = float(data.get("rms_norm_eps", 1e-5))
    ssm_cfg = mamba_ssm_cfg(data, d_model, eps)
    rotary_dim, base = rope_settings(data, head_dim, default_partial=0.5)
    attn_bias = bool(data.get("attention_bias", False))
    return ModelConfig(
        d_model=d_model,
        d_intermediate=int(data["intermediate_size"]),
        mlp_multiple=1,
        n_layer=int(data["num_hidden_layers"]),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg=ssm_cfg,
        attn_layer_idx=list(data.get("attn_layer_indices") or []),
        attn_cfg={
            "num_heads": heads,
            "num_heads_kv": int(data.get("num_key_value_heads") or heads),
            "head_dim": head_dim,
            "qkv_proj_bias": attn_bias,
            "out_proj_bias": attn_bias,
            "rotary_emb_dim": rotary_dim,
            "rotary_emb_base": base,
        },
        **hf_norm_fields(data, eps),
    )


def weights(sd: dict) -> dict:
    sd = rename(sd, mamba_layer_rules("final_layernorm", "pre_ff_layernorm") + [
        (r"^model\.layers\.(\d+)\.feed_forward\.", r"backbone.layers.\1.feed_forward."),
    ])
    for i in layer_indices(sd, "backbone.layers"):
        fuse_attention(sd, f"backbone.layers.{i}.self_attn", f"backbone.layers.{i}.mixer")
        fuse_swiglu(sd, f"backbone.layers.{i}.feed_forward", f"backbone.layers.{i}.mlp")
    return sd
