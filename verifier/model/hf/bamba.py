"""Bamba (``BambaForCausalLM``): Mamba2 + GQA attention with partial RoPE, a SwiGLU MLP after every mixer.

The layout is mamba_ssm's (norm, mixer, norm2, gated MLP), so it maps onto ``ModelConfig`` directly.
"""

from __future__ import annotations

from stree.verifier.model.config import ModelConfig, require_silu
from stree.verifier.model.hf.common import (gqa_attn_cfg, hf_norm_fields, mamba_ssm_cfg, refuse_unless,
                                             rope_settings, swiglu_decoder_fields)
from stree.verifier.model.hf.weights import swiglu_decoder_weights

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
    return ModelConfig(
        **swiglu_decoder_fields(data),
        ssm_cfg=mamba_ssm_cfg(data, expand, d_head, eps),
        attn_layer_idx=list(data.get("attn_layer_indices") or []),
        attn_cfg=gqa_attn_cfg(data, head_dim, rotary_dim, base),
        **hf_norm_fields(data, eps),
    )


def weights(sd: dict, data: dict) -> dict:
    return swiglu_decoder_weights(sd, "final_layernorm", "pre_ff_layernorm",
                                  {"mamba": "mixer", "self_attn": "self_attn", "feed_forward": "feed_forward"},
                                  attn=("self_attn", "mixer"), mlp="feed_forward")
