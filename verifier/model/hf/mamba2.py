"""Mamba2 (``Mamba2ForCausalLM``): Mamba2 layers, laid out as mamba_ssm's; mixer norm eps = ``layer_norm_epsilon``.

``num_heads * head_dim`` must fill ``expand * hidden_size`` (transformers refuses the config otherwise); the
gated norm always runs (older configs' ``rms_norm`` / ``norm_before_gate`` keys are not read by transformers).
"""

from __future__ import annotations

import math

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.fields import GENERATION_FIELDS, INIT, NUMERICS, ConfigSpec, dt_limit

MODEL_TYPE = "mamba2"
CLASS_NAME = "Mamba2ForCausalLM"

SPEC = ConfigSpec(
    class_name="Mamba2Config",
    defaults={
        "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
        "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "pad_token_id": 1, "bos_token_id": 0,
        "eos_token_id": 2, "expand": 2, "conv_kernel": 4, "n_groups": 8, "use_bias": False, "use_conv_bias": True,
        "hidden_act": "silu", "initializer_range": 0.1, "residual_in_fp32": True, "time_step_rank": "auto",
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "time_step_limit": [0.0, math.inf],
        "rescale_prenorm_residual": False, "use_cache": True, "chunk_size": 256, "tie_word_embeddings": False,
    },
    ignored={
        **GENERATION_FIELDS, "initializer_range": INIT, "time_step_min": INIT, "time_step_max": INIT,
        "time_step_floor": INIT,
        "rescale_prenorm_residual": INIT, "time_step_rank": "not used by Mamba2's mixer", "chunk_size": NUMERICS,
    },
    # older Mamba2 configs (e.g. Mamba-Codestral's) carry these; transformers does not read them
    extra_ignored=frozenset({"rms_norm", "norm_before_gate", "time_step_init_scheme", "time_step_scale",
                             "fused_add_norm", "pad_vocab_size_multiple", "layer_types"}),
)


def config(f) -> ModelConfig:
    f.refuse_unless("hidden_act", "silu", "swish")
    d_model, expand, head_dim = f.int("hidden_size"), f.int("expand"), f.int("head_dim")
    num_heads = f.int("num_heads")
    if num_heads * head_dim != expand * d_model:
        raise ValueError(f"config: num_heads*head_dim {num_heads}*{head_dim} != expand*hidden_size "
                         f"{expand}*{d_model}")
    eps = f.float("layer_norm_epsilon")
    return ModelConfig(
        d_model=d_model,
        n_layer=f.int("num_hidden_layers"),
        vocab_size=f.int("vocab_size"),
        ssm_cfg={
            "d_state": f.int("state_size"), "d_conv": f.int("conv_kernel"), "expand": expand, "headdim": head_dim,
            "ngroups": f.int("n_groups"), "bias": f.bool("use_bias"), "conv_bias": f.bool("use_conv_bias"),
            "dt_limit": dt_limit(f), "chunk_size": f.int("chunk_size"), "norm_eps": eps,
        },
        rms_norm=True,
        residual_in_fp32=f.bool("residual_in_fp32"),
        pad_vocab_size_multiple=1,
        tie_embeddings=f.bool("tie_word_embeddings"),
        norm_epsilon=eps,
    )


def weights(sd: dict, f) -> dict:
    return {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in sd.items()}
