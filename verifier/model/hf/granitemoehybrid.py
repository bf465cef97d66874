"""GraniteMoeHybrid (``GraniteMoeHybridForCausalLM``): Mamba2 or GQA attention (RoPE or none), then a MoE MLP.

The MLP slot holds softmax-routed gated experts plus a shared gated MLP; embedding, residual,
attention (softmax scale) and logits multipliers come from the config.
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig, _json_float, require_silu
from stree.verifier.model.hf.common import rope_settings, hf_norm_fields
from stree.verifier.model.hf.weights import fuse_attention, layer_indices, rename, stack_experts

MODEL_TYPE = "granitemoehybrid"
CLASS_NAME = "GraniteMoeHybridForCausalLM"
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def config(data: dict) -> ModelConfig:
    require_silu(data, "hidden_act")
    d_model = int(data["hidden_size"])
    n_layer = int(data["num_hidden_layers"])
    raw = data.get("layer_types") or data.get("layers_block_type") or ["mamba"] * n_layer
    unknown = sorted({k for k in raw if k not in _KINDS})
    if unknown:
        raise ValueError(f"config: layer_types entries {unknown} are not supported (only {sorted(_KINDS)})")
    kinds = [_KINDS[k] for k in raw]
    heads = int(data["num_attention_heads"])
    head_dim = d_model // heads
    pos = data.get("position_embedding_type")
    if pos not in (None, "rope", "nope"):
        raise ValueError(f"config: position_embedding_type={pos!r} is not supported (only 'rope' or none)")
    rotary_dim, base = rope_settings(data, head_dim) if pos == "rope" else (0, 10000.0)
    n_heads = int(data["mamba_n_heads"])
    expand = int(data.get("mamba_expand", 2))
    d_head = data.get("mamba_d_head", "auto")
    d_head = expand * d_model // n_heads if d_head in (None, "auto") else int(d_head)
    if d_head * n_heads != expand * d_model:
        raise ValueError(f"config: mamba_n_heads*mamba_d_head {n_heads * d_head} != mamba_expand*hidden_size")
    eps = float(data.get("rms_norm_eps", 1e-6))
    attn_bias = bool(data.get("attention_bias", False))
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg={
            "d_state": int(data.get("mamba_d_state", 256)), "d_conv": int(data.get("mamba_d_conv", 4)),
            "expand": expand, "headdim": d_head, "ngroups": int(data.get("mamba_n_groups", 1)),
            "bias": bool(data.get("mamba_proj_bias", False)), "conv_bias": bool(data.get("mamba_conv_bias", True)),
            "dt_limit": [_json_float(x) for x in (data.get("time_step_limit") or [0.0, math.inf])],
            "chunk_size": int(data.get("mamba_chunk_size", 256)), "norm_eps": eps,
        },
        attn_layer_idx=[i for i, k in enumerate(kinds) if k == "attention"],
        attn_cfg={
            "num_heads": heads, "num_heads_kv": int(data.get("num_key_value_heads") or heads), "head_dim": head_dim,
            "qkv_proj_bias": attn_bias, "out_proj_bias": attn_bias, "rotary_emb_dim": rotary_dim,
            "rotary_emb_base": base, "softmax_scale": float(data.get("attention_multiplier", 1.0)),
        },
        moe_mlp={
            "n_experts": int(data.get("num_local_experts") or 0), "top_k": int(data.get("num_experts_per_tok", 2)),
            "hidden": int(data["intermediate_size"]), "shared_hidden": int(data["shared_intermediate_size"]),
        },
        embedding_multiplier=float(data.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(data.get("residual_multiplier", 1.0)),
        logits_scaling=float(data.get("logits_scaling", 1.0)),
        **hf_norm_fields(data, eps),
    )


def weights(sd: dict) -> dict:
    sd = rename(sd, [
        (r"^model\.embed_tokens\.", "backbone.embedding."),
        (r"^model\.norm\.", "backbone.norm_f."),
        (r"^model\.layers\.(\d+)\.input_layernorm\.", r"backbone.layers.\1.norm."),
        (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"backbone.layers.\1.norm2."),
        (r"^model\.layers\.(\d+)\.mamba\.", r"backbone.layers.\1.mixer."),
        (r"^model\.layers\.(\d+)\.self_attn\.", r"backbone.layers.\1.self_attn."),
        (r"^model\.layers\.(\d+)\.shared_mlp\.input_linear\.", r"backbone.layers.\1.mlp.shared_in."),
        (r"^model\.layers\.(\d+)\.shared_mlp\.output_linear\.", r"backbone.layers.\1.mlp.shared_out."),
        (r"^model\.layers\.(\d+)\.block_sparse_moe\.router\.(layer\.)?", r"backbone.layers.\1.mlp.router."),
        (r"^model\.layers\.(\d+)\.block_sparse_moe\.input_linear\.weight", r"backbone.layers.\1.mlp.gate_up_proj"),
        (r"^model\.layers\.(\d+)\.block_sparse_moe\.output_linear\.weight", r"backbone.layers.\1.mlp.down_proj"),
        (r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.", r"backbone.layers.\1.mlp.experts."),
    ])
    for i in layer_indices(sd, "backbone.layers"):
        fuse_attention(sd, f"backbone.layers.{i}.self_attn", f"backbone.layers.{i}.mixer")
        prefix = f"backbone.layers.{i}.mlp"
        stack_experts(sd, f"{prefix}.experts", ("gate_up_proj", "down_proj"))
        for proj in ("gate_up_proj", "down_proj"):
            if f"{prefix}.experts.{proj}" in sd:
                sd[f"{prefix}.{proj}"] = sd.pop(f"{prefix}.experts.{proj}")
    return sd
