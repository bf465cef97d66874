"""NemotronH (``NemotronHForCausalLM``): one mixer per layer (Mamba2, attention without RoPE, relu^2 MLP or MoE).

MoE layers route with sigmoid scores plus a correction bias and add a shared expert; Mamba2 dt is
clamped to (time_step_min, inf), as the family defines it.
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig, require_silu
from stree.verifier.model.hf.common import hf_norm_fields, map_layer_types, refuse_unless
from stree.verifier.model.hf.weights import fuse_attention, layer_indices, rename, stack_experts

MODEL_TYPE = "nemotron_h"
CLASS_NAME = "NemotronHForCausalLM"
_KINDS = {"M": "mamba", "mamba": "mamba", "linear_attention": "mamba", "*": "attention",
          "attention": "attention", "full_attention": "attention", "-": "mlp", "mlp": "mlp", "E": "moe", "moe": "moe"}


def layer_types(data: dict) -> list[str]:
    raw = data.get("layers_block_type") or data.get("layer_types") or list(data.get("hybrid_override_pattern") or "")
    if not raw:
        raise ValueError("config: NemotronH needs layers_block_type (or hybrid_override_pattern)")
    return map_layer_types(raw, _KINDS, "layers_block_type")


def config(data: dict) -> ModelConfig:
    require_silu(data, "mamba_hidden_act")
    act = data.get("mlp_hidden_act", "relu2")
    if act not in ("relu2", "silu"):
        raise ValueError(f"config: mlp_hidden_act={act!r} is not supported (only 'relu2' or 'silu')")
    refuse_unless(data, "mlp_bias", False)
    refuse_unless(data, "moe_latent_size", None)
    refuse_unless(data, "sliding_window", None)
    d_model = int(data["hidden_size"])
    kinds = layer_types(data)
    mamba_inner = int(data["mamba_num_heads"]) * int(data["mamba_head_dim"])
    if mamba_inner % d_model:
        raise ValueError(f"config: mamba_num_heads*mamba_head_dim {mamba_inner} is not a multiple of hidden_size")
    heads = int(data["num_attention_heads"])
    eps = float(data.get("layer_norm_epsilon", 1e-5))
    moe = {
        "kind": "moe", "act": act, "n_experts": int(data["n_routed_experts"]),
        "top_k": int(data["num_experts_per_tok"]), "hidden": int(data["moe_intermediate_size"]),
        "shared_hidden": int(data["moe_shared_expert_intermediate_size"]), "n_group": int(data.get("n_group", 1)),
        "topk_group": int(data.get("topk_group", 1)), "norm_topk": bool(data.get("norm_topk_prob", True)),
        "scale": float(data.get("routed_scaling_factor", 1.0)),
    }
    mlp = {"kind": "mlp", "act": act, "hidden": int(data["intermediate_size"])}
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg={
            "d_state": int(data["ssm_state_size"]),
            "d_conv": int(data.get("conv_kernel", 4)),
            "expand": mamba_inner // d_model,
            "headdim": int(data["mamba_head_dim"]),
            "ngroups": int(data.get("n_groups", 1)),
            "bias": bool(data.get("mamba_proj_bias", False)),
            "conv_bias": bool(data.get("use_conv_bias", True)),
            "dt_limit": [float(data.get("time_step_min", 0.001)), math.inf],
            "chunk_size": int(data.get("chunk_size", 128)),
            "norm_eps": eps,
        },
        attn_layer_idx=[i for i, k in enumerate(kinds) if k == "attention"],
        attn_cfg={
            "num_heads": heads,
            "num_heads_kv": int(data.get("num_key_value_heads") or heads),
            "head_dim": int(data.get("head_dim") or d_model // heads),
            "qkv_proj_bias": False,
            "out_proj_bias": False,
            "rotary_emb_dim": 0,
        },
        layer_mixers={i: (moe if k == "moe" else mlp) for i, k in enumerate(kinds) if k in ("mlp", "moe")},
        **hf_norm_fields(data, eps),
    )


def weights(sd: dict, data: dict) -> dict:
    sd = rename(sd, [
        (r"^(model|backbone)\.embeddings?\.", "backbone.embedding."),
        (r"^(model|backbone)\.norm_f\.", "backbone.norm_f."),
        (r"^(model|backbone)\.layers\.", "backbone.layers."),
    ])
    for i in layer_indices(sd, "backbone.layers"):
        fuse_attention(sd, f"backbone.layers.{i}.mixer", f"backbone.layers.{i}.mixer")
        stack_experts(sd, f"backbone.layers.{i}.mixer.experts")
    return sd
