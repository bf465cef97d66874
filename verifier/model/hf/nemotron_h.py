"""NemotronH (``NemotronHForCausalLM``): one mixer per layer (Mamba2, attention without RoPE, relu^2 MLP or MoE).

MoE layers route with sigmoid scores plus a correction bias and add a shared expert (optionally through a latent
projection, ``moe_latent_size``); Mamba2 dt is clamped to (``time_step_min``, inf), the Mamba projections carry
biases when ``use_bias`` says so, and the output layer is never tied to the embedding (transformers' NemotronH
has no tied weights, whatever ``tie_word_embeddings`` says). Multi-token-prediction weights (``mtp.*``) are not
used by the forward pass; loading warns about them.
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import hf_norm_fields, kv_heads, map_layer_types
from stree.verifier.model.hf.fields import (DECODER_IGNORED, GENERATION, INIT, NUMERICS, TRAINING, ConfigSpec,
                                            warn_unread)
from stree.verifier.model.hf.weights import fuse_attention, layer_indices, rename, stack_experts

MODEL_TYPE = "nemotron_h"
CLASS_NAME = "NemotronHForCausalLM"
_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}

SPEC = ConfigSpec(
    class_name="NemotronHConfig",
    defaults={
        "vocab_size": 131072, "hidden_size": 4096, "layers_block_type": None, "tie_word_embeddings": False,
        "use_cache": True, "num_logits_to_keep": 1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
        "attention_bias": False, "attention_dropout": 0.0, "sliding_window": None, "intermediate_size": 21504,
        "mlp_hidden_act": "relu2", "mlp_bias": False, "use_mamba_kernels": True, "ssm_state_size": 128,
        "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
        "expand": 2, "time_step_min": 0.001, "time_step_max": 0.1, "time_step_limit": [0.0, math.inf],
        "time_step_floor": 1e-4, "use_conv_bias": True, "chunk_size": 128, "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32", "n_routed_experts": 8, "output_router_logits": False,
        "n_shared_experts": 1, "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
        "moe_latent_size": None, "moe_shared_expert_overlap": True, "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "num_nextn_predict_layers": 0, "mtp_layers_block_type": None, "use_bias": False, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "hidden_dropout": 0.0,
        "rescale_prenorm_residual": True,
    },
    ignored={
        **DECODER_IGNORED, "tie_word_embeddings": "NemotronH never ties its output layer",
        "num_logits_to_keep": GENERATION, "max_position_embeddings": "no RoPE",
        "attention_bias": "NemotronH's attention projections never have biases",
        "sliding_window": "NemotronH's causal mask does not read it", "use_mamba_kernels": TRAINING,
        "expand": "the Mamba width is mamba_num_heads*mamba_head_dim", "time_step_max": INIT,
        "time_step_limit": "NemotronH clamps dt to (time_step_min, inf)", "time_step_floor": INIT,
        "chunk_size": NUMERICS, "mamba_proj_bias": "NemotronH's Mamba projections read use_bias",
        "mamba_ssm_cache_dtype": GENERATION, "output_router_logits": TRAINING,
        "n_shared_experts": "one shared expert MLP whatever it says", "moe_shared_expert_overlap": TRAINING,
        "num_nextn_predict_layers": "multi-token prediction layers are not part of the forward pass",
        "mtp_layers_block_type": "multi-token prediction layers are not part of the forward pass",
        "residual_in_fp32": "NemotronH's blocks do not read it",
        "hidden_dropout": TRAINING, "rescale_prenorm_residual": INIT,
    },
    aliases={
        "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
        "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
        "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
        "mamba_chunk_size": "chunk_size",
    },
    optional={"hybrid_override_pattern": None, "layer_types": None},
    # num_hidden_layers is derived from layers_block_type; the rest are older remote-code configs' keys
    extra_ignored=frozenset({"num_hidden_layers", "mtp_hybrid_override_pattern", "attention_head_dim",
                             "rms_norm_eps", "time_step_rank"}),
)


def layer_types(f) -> list[str]:
    """``layer_types`` (set last by transformers, over the field it aliases), ``layers_block_type``, else
    ``hybrid_override_pattern``, else the class default."""
    raw = f["layer_types"] if f.get("layer_types") is not None else f.get("layers_block_type")
    if raw is None and f.get("hybrid_override_pattern") is not None:
        pattern = f["hybrid_override_pattern"]
        bad = sorted({c for c in str(pattern) if c not in _PATTERN})
        if bad:
            raise ValueError(f"config: hybrid_override_pattern characters {bad} are not one of {sorted(_PATTERN)}")
        raw = [_PATTERN[c] for c in pattern]
    if raw is None:
        raw = ["linear_attention", "moe", "full_attention", "mlp"]
    return map_layer_types(raw, _KINDS, "layers_block_type")


def config(f) -> ModelConfig:
    f.refuse_unless("mamba_hidden_act", "silu", "swish")
    f.refuse_unless("mlp_hidden_act", "relu2", "silu", "swish")
    act = "silu" if f["mlp_hidden_act"] == "swish" else f["mlp_hidden_act"]
    d_model = f.int("hidden_size")
    kinds = layer_types(f)
    mamba_inner = f.int("mamba_num_heads") * f.int("mamba_head_dim")
    if mamba_inner % d_model:
        raise ValueError(f"config: mamba_num_heads*mamba_head_dim {mamba_inner} is not a multiple of "
                         f"hidden_size {d_model}")
    heads = f.int("num_attention_heads")
    eps = f.float("layer_norm_epsilon")
    bias = f.bool("mlp_bias")
    moe = {
        "kind": "moe", "act": act, "n_experts": f.int("n_routed_experts"), "top_k": f.int("num_experts_per_tok"),
        "hidden": f.int("moe_intermediate_size"), "shared_hidden": f.int("moe_shared_expert_intermediate_size"),
        "n_group": f.int("n_group"), "topk_group": f.int("topk_group"), "norm_topk": f.bool("norm_topk_prob"),
        "scale": f.float("routed_scaling_factor"), "latent": f.int("moe_latent_size", allow_none=True), "bias": bias,
    }
    mlp = {"kind": "mlp", "act": act, "hidden": f.int("intermediate_size"), "bias": bias}
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=f.int("vocab_size"),
        ssm_cfg={
            "d_state": f.int("ssm_state_size"), "d_conv": f.int("conv_kernel"), "expand": mamba_inner // d_model,
            "headdim": f.int("mamba_head_dim"), "ngroups": f.int("n_groups"), "bias": f.bool("use_bias"),
            "conv_bias": f.bool("use_conv_bias"), "dt_limit": [f.float("time_step_min"), math.inf],
            "chunk_size": f.int("chunk_size"), "norm_eps": eps,
        },
        attn_layer_idx=[i for i, k in enumerate(kinds) if k == "attention"],
        attn_cfg={
            "num_heads": heads, "num_heads_kv": kv_heads(f, heads), "head_dim": f.int("head_dim"),
            "qkv_proj_bias": False, "out_proj_bias": False, "rotary_emb_dim": 0,
        },
        layer_mixers={i: (moe if k == "moe" else mlp) for i, k in enumerate(kinds) if k in ("mlp", "moe")},
        **hf_norm_fields(f, eps, tie=False),
    )


def weights(sd: dict, f) -> dict:
    mtp = [k for k in sd if k.startswith("mtp.")]
    warn_unread(mtp, "multi-token prediction layers; transformers ignores them too")
    sd = rename({k: v for k, v in sd.items() if not k.startswith("mtp.")}, [
        (r"^(model|backbone)\.embeddings?\.", "backbone.embedding."),
        (r"^(model|backbone)\.norm_f\.", "backbone.norm_f."),
        (r"^(model|backbone)\.layers\.", "backbone.layers."),
    ])
    for i in layer_indices(sd, "backbone.layers"):
        fuse_attention(sd, f"backbone.layers.{i}.mixer", f"backbone.layers.{i}.mixer")
        stack_experts(sd, f"backbone.layers.{i}.mixer.experts")
    return sd
