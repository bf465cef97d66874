"""Bamba (``BambaForCausalLM``): Mamba2 + GQA attention with partial RoPE, a SwiGLU MLP after every mixer.

The layout is mamba_ssm's (norm, mixer, norm2, gated MLP), so it maps onto ``ModelConfig`` directly. RoPE rotates
``rope_parameters.partial_rotary_factor`` of each head: the class puts 0.5 there when the config names none
(a top-level ``partial_rotary_factor`` key is overridden by that 0.5, as transformers does).
"""

from __future__ import annotations

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import (MAMBA_DECODER_DEFAULTS, ROPE_KEYS, attention_head_dim, default_rope,
                                            gqa_attn_cfg, hf_norm_fields, mamba_head, mamba_ssm_cfg,
                                            swiglu_decoder_fields)
from stree.verifier.model.hf.fields import DECODER_IGNORED, GENERATION, NUMERICS, TRAINING, ConfigSpec
from stree.verifier.model.hf.weights import swiglu_decoder_weights

MODEL_TYPE = "bamba"
CLASS_NAME = "BambaForCausalLM"
_FORCED_PARTIAL_ROTARY = 0.5  # BambaConfig.__post_init__: kwargs["partial_rotary_factor"] = 0.5

SPEC = ConfigSpec(
    class_name="BambaConfig",
    defaults={**MAMBA_DECODER_DEFAULTS, "max_position_embeddings": 262144, "attn_layer_indices": None,
              "z_loss_coefficient": 0.0},
    ignored={**DECODER_IGNORED, "num_logits_to_keep": GENERATION, "mamba_chunk_size": NUMERICS,
             "z_loss_coefficient": TRAINING},
    optional={"head_dim": None, **ROPE_KEYS},
    # properties derived from attn_layer_indices, and transformers 4.x's rotary width (the class now forces 0.5)
    extra_ignored=frozenset({"layers_block_type", "layer_types", "attn_rotary_emb"}),
)


def config(f) -> ModelConfig:
    f.refuse_unless("hidden_act", "silu", "swish")
    d_model = f.int("hidden_size")
    head_dim = attention_head_dim(f)
    expand = f.int("mamba_expand")
    d_head = mamba_head(f, expand * d_model, "mamba_expand*hidden_size")
    rotary_dim, base = default_rope(f, head_dim, honour_partial=True, partial_rotary_factor=_FORCED_PARTIAL_ROTARY)
    eps = f.float("rms_norm_eps")
    return ModelConfig(
        **swiglu_decoder_fields(f),
        ssm_cfg=mamba_ssm_cfg(f, expand, d_head, eps),
        # layer i attends when i is listed (transformers does not read entries past the last layer)
        attn_layer_idx=[i for i in range(f.int("num_hidden_layers")) if i in (f.get("attn_layer_indices") or [])],
        attn_cfg=gqa_attn_cfg(f, head_dim, rotary_dim, base),
        **hf_norm_fields(f, eps),
    )


def weights(sd: dict, f) -> dict:
    return swiglu_decoder_weights(sd, "final_layernorm", "pre_ff_layernorm",
                                  {"mamba": "mixer", "self_attn": "self_attn", "feed_forward": "feed_forward"},
                                  attn=("self_attn", "mixer"), mlp="feed_forward")
