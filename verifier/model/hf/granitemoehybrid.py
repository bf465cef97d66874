"""GraniteMoeHybrid (``GraniteMoeHybridForCausalLM``): Mamba2 or GQA attention (RoPE or none), then a MoE MLP.

The MLP slot holds softmax-routed gated experts plus a shared gated MLP; embedding, residual,
attention (softmax scale) and logits multipliers come from the config.
"""

from __future__ import annotations

from stree.verifier.model.config import ModelConfig, require_silu
from stree.verifier.model.hf.common import gqa_attn_cfg, hf_norm_fields, mamba_ssm_cfg, map_layer_types, rope_settings
from stree.verifier.model.hf.weights import decoder_rules, fuse_attention, layer_indices, rename, stack_experts

MODEL_TYPE = "granitemoehybrid"
CLASS_NAME = "GraniteMoeHybridForCausalLM"
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def config(data: dict) -> ModelConfig:
    require_silu(data, "hidden_act")
    d_model = int(data["hidden_size"])
    n_layer = int(data["num_hidden_layers"])
    raw = data.get("layer_types") or data.get("layers_block_type") or ["mamba"] * n_layer
    kinds = map_layer_types(raw, _KINDS, "layer_types")
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
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg=mamba_ssm_cfg(data, expand, d_head, eps),
        attn_layer_idx=[i for i, k in enumerate(kinds) if k == "attention"],
        attn_cfg=gqa_attn_cfg(data, head_dim, rotary_dim, base,
                              softmax_scale=float(data.get("attention_multiplier", 1.0))),
        moe_mlp={
            "n_experts": int(data.get("num_local_experts") or 0), "top_k": int(data.get("num_experts_per_tok", 2)),
            "hidden": int(data["intermediate_size"]), "shared_hidden": int(data["shared_intermediate_size"]),
        },
        embedding_multiplier=float(data.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(data.get("residual_multiplier", 1.0)),
        logits_scaling=float(data.get("logits_scaling", 1.0)),
        **hf_norm_fields(data, eps),
    )


def weights(sd: dict, data: dict) -> dict:
    sd = rename(sd, decoder_rules("norm", "post_attention_layernorm", {"mamba": "mixer", "self_attn": "self_attn"}) + [
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
