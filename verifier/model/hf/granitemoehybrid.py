"""GraniteMoeHybrid (``GraniteMoeHybridForCausalLM``): Mamba2 or GQA attention (RoPE or none), then a MoE MLP.

The MLP slot holds softmax-routed gated experts plus a shared gated MLP; embedding, residual, attention (softmax
scale) and logits multipliers come from the config. The attention heads are ``head_dim`` wide when config.json
has that key (transformers reads it with ``getattr``), else ``hidden_size / num_attention_heads``; RoPE runs
only when ``position_embedding_type`` is ``"rope"`` and always rotates the whole head (the class's rotary
embedding does not read ``partial_rotary_factor``).
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import (LLAMA_DEFAULTS, ROPE_KEYS, attention_head_dim, default_rope,
                                            gqa_attn_cfg, hf_norm_fields, mamba_head, mamba_ssm_cfg, map_layer_types)
from stree.verifier.model.hf.fields import DECODER_IGNORED, NUMERICS, TRAINING, ConfigSpec
from stree.verifier.model.hf.weights import decoder_rules, fuse_attention, layer_indices, rename, stack_experts

MODEL_TYPE = "granitemoehybrid"
CLASS_NAME = "GraniteMoeHybridForCausalLM"
_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}

SPEC = ConfigSpec(
    class_name="GraniteMoeHybridConfig",
    defaults={
        **LLAMA_DEFAULTS, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
        "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "shared_intermediate_size": 1024, "position_embedding_type": None,
        "layer_types": None, "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto",
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
        "mamba_proj_bias": False, "time_step_limit": [0.0, math.inf],
    },
    ignored={**DECODER_IGNORED, "output_router_logits": TRAINING, "router_aux_loss_coef": TRAINING,
             "mamba_chunk_size": NUMERICS},
    optional={"head_dim": None, "layers_block_type": None, **ROPE_KEYS},
)


def config(f) -> ModelConfig:
    f.refuse_unless("hidden_act", "silu", "swish")  # the Mamba conv/gate, the experts' and the shared MLP's
    d_model = f.int("hidden_size")
    n_layer = f.int("num_hidden_layers")
    raw = f["layers_block_type"] if f.get("layers_block_type") is not None else f.get("layer_types")
    kinds = map_layer_types(["linear_attention"] * n_layer if raw is None else raw, _KINDS, "layer_types")
    if len(kinds) != n_layer:  # transformers' validation refuses this too
        raise ValueError(f"config: layer_types has {len(kinds)} entries for num_hidden_layers={n_layer}")
    head_dim = attention_head_dim(f)
    rope = f.get("position_embedding_type") == "rope"  # any other value: no positional embedding, as transformers
    rotary_dim, base = default_rope(f, head_dim, honour_partial=False) if rope else (0, 10000.0)
    expand = f.int("mamba_expand")
    d_head = mamba_head(f, expand * d_model, "mamba_expand*hidden_size")
    eps = f.float("rms_norm_eps")
    return ModelConfig(
        d_model=d_model,
        n_layer=n_layer,
        vocab_size=f.int("vocab_size"),
        ssm_cfg=mamba_ssm_cfg(f, expand, d_head, eps),
        attn_layer_idx=[i for i, k in enumerate(kinds) if k == "attention"],
        attn_cfg=gqa_attn_cfg(f, head_dim, rotary_dim, base, softmax_scale=f.float("attention_multiplier")),
        moe_mlp={
            "n_experts": f.int("num_local_experts"), "top_k": f.int("num_experts_per_tok"),
            "hidden": f.int("intermediate_size"), "shared_hidden": f.int("shared_intermediate_size"),
        },
        embedding_multiplier=f.float("embedding_multiplier"),
        residual_multiplier=f.float("residual_multiplier"),
        logits_scaling=f.float("logits_scaling"),
        **hf_norm_fields(f, eps),
    )


def weights(sd: dict, f) -> dict:
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
