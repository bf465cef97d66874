"""Config checks shared by the Hugging Face families: refuse fields whose value would change the math."""

from __future__ import annotations

import math

from stree.verifier.model.config import _json_float


def refuse_unless(data: dict, key: str, allowed) -> None:
    """Raise a ValueError naming ``key`` when its value (if present) differs from ``allowed``."""
    if key in data and data[key] is not None and data[key] != allowed:
        raise ValueError(f"config: {key}={data[key]!r} is not supported (only {allowed!r})")


def map_layer_types(raw: list, kinds: dict[str, str], field: str) -> list[str]:
    """Each entry of the config's ``field`` list mapped through ``kinds``; a ValueError names entries it lacks."""
    unknown = sorted({k for k in raw if k not in kinds})
    if unknown:
        raise ValueError(f"config: {field} entries {unknown} are not supported (only {sorted(kinds)})")
    return [kinds[k] for k in raw]


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


def gqa_attn_cfg(data: dict, head_dim: int, rotary_dim: int, base: float, **extra) -> dict:
    """``attn_cfg`` for transformers' GQA attention: heads and KV heads, q/k/v/o biases from ``attention_bias``, RoPE."""
    heads = int(data["num_attention_heads"])
    bias = bool(data.get("attention_bias", False))
    return {"num_heads": heads, "num_heads_kv": int(data.get("num_key_value_heads") or heads), "head_dim": head_dim,
            "qkv_proj_bias": bias, "out_proj_bias": bias, "rotary_emb_dim": rotary_dim, "rotary_emb_base": base,
            **extra}


def mamba_ssm_cfg(data: dict, expand, d_head: int, eps: float, **extra) -> dict:
    """``ssm_cfg`` from the ``mamba_*`` fields Bamba, GraniteMoeHybrid and Falcon-H1 share (with their defaults)."""
    return {
        "d_state": int(data.get("mamba_d_state", 256)), "d_conv": int(data.get("mamba_d_conv", 4)),
        "expand": expand, "headdim": d_head, "ngroups": int(data.get("mamba_n_groups", 1)),
        "bias": bool(data.get("mamba_proj_bias", False)), "conv_bias": bool(data.get("mamba_conv_bias", True)),
        "dt_limit": [_json_float(x) for x in (data.get("time_step_limit") or [0.0, math.inf])],
        "chunk_size": int(data.get("mamba_chunk_size", 256)), "norm_eps": eps, **extra,
    }


def swiglu_decoder_fields(data: dict) -> dict:
    """``ModelConfig`` fields of a decoder whose every layer ends in a SwiGLU MLP of ``intermediate_size``
    (Bamba, Falcon-H1, MambaInLlama): width, depth, vocabulary."""
    return dict(d_model=int(data["hidden_size"]), d_intermediate=int(data["intermediate_size"]), mlp_multiple=1,
                n_layer=int(data["num_hidden_layers"]), vocab_size=int(data["vocab_size"]))
