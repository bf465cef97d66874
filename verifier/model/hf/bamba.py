"""Bamba (``BambaForCausalLM``): Mamba2 + GQA attention with partial RoPE, a SwiGLU MLP after every mixer.

The layout is mamba_ssm's (norm, mixer, norm2, gated MLP), so it maps onto ``ModelConfig`` directly.
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig, _json_float, require_silu
from stree.verifier.model.hf.common import refuse_unless, rope_settings, hf_norm_fields
from stree.verifier.model.hf.weights import fuse_attention, fuse_swiglu, layer_indices, rename

MODEL_TYPE = "bamba"
CLASS_NAME = "BambaForCausalLM"


def config(data: dict) -> ModelConfig:
    require_silu(data, "hidden_act")
    refuse_unless(data, "mlp_bias", False)
    d_model = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    head_dim = int(data.get("head_dim") or d_model // heads)
    n_heads = int(data["mamba_n_heads"])
    d_head = data.get("mamba_d_head", "auto")
    expand = int(data.get("mamba_expand", 2))
    d_head = expand * d_model // n_heads if d_head in (None, "auto") else int(d_head)
    if d_head * n_heads != expand * d_model:
        raise ValueError(f"config: mamba_n_heads*mamba_d_head {n_heads * d_head} != mamba_expand*hidden_size")
    rotary_dim, base = rope_settings(data, head_dim, default_partial=0.5)
    eps = float(data.get("rms_norm_eps", 1e-5))
    attn_bias = bool(data.get("attention_bias", False))
    return ModelConfig(
        d_model=d_model,
        d_intermediate=int(data["intermediate_size"]),
        mlp_multiple=1,
        n_layer=int(data["num_hidden_layers"]),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg={
            "d_state": int(data.get("mamba_d_state", 256)),
            "d_conv": int(data.get("mamba_d_conv", 4)),
            "expand": expand,
            "headdim": d_head,
            "ngroups": int(data.get("mamba_n_groups", 1)),
            "bias": bool(data.get("mamba_proj_bias", False)),
            "conv_bias": bool(data.get("mamba_conv_bias", True)),
            "dt_limit": [_json_float(x) for x in (data.get("time_step_limit") or [0.0, math.inf])],
            "chunk_size": int(data.get("mamba_chunk_size", 256)),
            "norm_eps": eps,
        },
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
    sd = rename(sd, [
        (r"^model\.embed_tokens\.", "backbone.embedding."),
        (r"^model\.final_layernorm\.", "backbone.norm_f."),
        (r"^model\.layers\.(\d+)\.input_layernorm\.", r"backbone.layers.\1.norm."),
        (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"backbone.layers.\1.norm2."),
        (r"^model\.layers\.(\d+)\.mamba\.", r"backbone.layers.\1.mixer."),
        (r"^model\.layers\.(\d+)\.self_attn\.", r"backbone.layers.\1.self_attn."),
        (r"^model\.layers\.(\d+)\.feed_forward\.", r"backbone.layers.\1.feed_forward."),
    ])
    for i in layer_indices(sd, "backbone.layers"):
        fuse_attention(sd, f"backbone.layers.{i}.self_attn", f"backbone.layers.{i}.mixer")
        fuse_swiglu(sd, f"backbone.layers.{i}.feed_forward", f"backbone.layers.{i}.mlp")
    return sd
