"""Config pieces shared by the Hugging Face families: checks that refuse fields whose value would change
the math, RoPE settings, the Mamba2 ``mamba_*`` fields, and the norm/vocabulary fields."""

from __future__ import annotations

import math

from stree.verifier.model.config import _json_float


def refuse_unless(data: dict, key: str, allowed) -> None:
    """Raise a ValueError naming ``key`` when its value (if present) differs from ``allowed``."""
    if key in data and data[key] is not None and data[key] != allowed:
        raise ValueError(f"config: {key}={data[key]!r} is not supported (only {allowed!r})")


def rope_settings(data: dict, head_dim: int, default_partial: float = 1.0) -> tuple[int, float]:
    """(rotary dim, base) from ``rope_parameters`` (transformers 5) or the older flat fields; plain RoPE only."""
    rope = dict(data.get("rope_parameters") or {})
    scaling = data.get("rope_scaling")
    if scaling:
        rope = {**scaling, **rope}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config: rope_type={rope_type!r} is not supported (only 'default')")
    partial = float(rope.get("partial_rotary_factor", data.get("partial_rotary_factor", default_partial)))
    base = float(rope.get("rope_theta", data.get("rope_theta", 10000.0)))
    return int(head_dim * partial), base


def hf_norm_fields(data: dict, eps: float) -> dict:
    """The ModelConfig fields every HF hybrid shares: RMSNorm with ``eps``, residual in the model
    dtype (as transformers keeps it), the real vocabulary (no padding), tied or untied embeddings."""
    return dict(rms_norm=True, residual_in_fp32=False, pad_vocab_size_multiple=1,
                tie_embeddings=bool(data.get("tie_word_embeddings", False)), norm_epsilon=eps)


def mamba_ssm_cfg(data: dict, d_model: int, eps: float) -> dict:
    """``ssm_cfg`` from the ``mamba_*`` fields (Bamba, GraniteMoeHybrid); ``mamba_d_head`` "auto" (or none)
    makes the heads fill ``mamba_expand * hidden_size``, and any other value must fill it exactly."""
    n_heads = int(data["mamba_n_heads"])
    expand = int(data.get("mamba_expand", 2))
    d_head = data.get("mamba_d_head", "auto")
    d_head = expand * d_model // n_heads if d_head in (None, "auto") else int(d_head)
    if d_head * n_heads != expand * d_model:
        raise ValueError(f"config: mamba_n_heads*mamba_d_head {n_heads * d_head} != mamba_expand*hidden_size")
    return {
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
    }
