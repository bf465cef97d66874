"""Config pieces shared by the Hugging Face families: RoPE as transformers standardises it, layer kinds, and the
``ModelConfig`` fields several families build the same way."""

from __future__ import annotations

import math

from stree.verifier.model.hf.fields import Fields, dt_limit

# LlamaConfig's defaults, which GraniteMoeHybridConfig starts from
LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
    "attention_dropout": 0.0,
}
# the defaults BambaConfig and FalconH1Config share
MAMBA_DECODER_DEFAULTS = {
    "vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
    "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "num_logits_to_keep": 1, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0, "mamba_n_heads": 128, "mamba_d_head": "auto",
    "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": [0.0, math.inf], "rope_parameters": None,
    "attention_bias": False, "mlp_bias": False,
}
# keys transformers folds into ``rope_parameters`` (``convert_rope_params_to_dict``): read when present
ROPE_KEYS = {"rope_scaling": None, "rope_theta": None, "partial_rotary_factor": None}
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def map_layer_types(raw, kinds: dict[str, str], key: str) -> list[str]:
    """Each entry of the config's ``key`` list (legacy names remapped as transformers does) mapped through
    ``kinds``; a ValueError names entries it lacks."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"config: {key}={raw!r} must be a list")
    raw = [_LEGACY_LAYER_TYPES.get(k, k) for k in raw]
    unknown = sorted({str(k) for k in raw if k not in kinds})
    if unknown:
        raise ValueError(f"config: {key} entries {unknown} are not supported (only {sorted(kinds)})")
    return [kinds[k] for k in raw]


def rope_parameters(f: Fields, partial_rotary_factor: float | None = None) -> dict:
    """``rope_parameters`` as transformers standardises it: ``rope_scaling`` replaces it when given, then
    ``rope_theta`` (default 10000) and ``partial_rotary_factor`` fill what it lacks (``partial_rotary_factor``:
    a value the class forces over the config's top-level key, as Bamba's does)."""
    rope = dict(f.get("rope_scaling") or f.get("rope_parameters") or {})
    if not isinstance(rope, dict):
        raise ValueError(f"config: rope_parameters={rope!r} must be an object")
    rope.setdefault("rope_theta", 10000.0 if f.get("rope_theta") is None else f["rope_theta"])
    partial = f.get("partial_rotary_factor") if partial_rotary_factor is None else partial_rotary_factor
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def default_rope(f: Fields, head_dim: int, honour_partial: bool, partial_rotary_factor: float | None = None
                 ) -> tuple[int, float]:
    """(rotary dim, base) of plain RoPE; ``honour_partial``: the family's rotary embedding rotates
    ``partial_rotary_factor`` of the head (Bamba's), else the whole head whatever the factor says."""
    rope = rope_parameters(f, partial_rotary_factor)
    if rope["rope_type"] != "default":
        raise ValueError(f"config: rope_parameters.rope_type={rope['rope_type']!r} is not supported (only 'default')")
    base = Fields(rope, f.class_name).float("rope_theta")
    if not honour_partial:
        return head_dim, base
    factor = Fields(rope, f.class_name).float("partial_rotary_factor", allow_none=True)
    dim = int(head_dim * (1.0 if factor is None else factor))
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"config: rope_parameters.partial_rotary_factor={factor!r} gives rotary dimension {dim} "
                         f"of a {head_dim}-wide head (only an even dimension up to the head size is supported)")
    return dim, base


def hf_norm_fields(f: Fields, eps: float, tie: bool | None = None) -> dict:
    """The ModelConfig fields every HF hybrid shares: RMSNorm with ``eps``, residual in the model dtype (as
    transformers keeps it), the real vocabulary (no padding), the head tied as ``tie_word_embeddings`` says
    (or ``tie``, for a family whose transformers class decides it otherwise)."""
    return dict(rms_norm=True, residual_in_fp32=False, pad_vocab_size_multiple=1,
                tie_embeddings=f.bool("tie_word_embeddings") if tie is None else tie, norm_epsilon=eps)


def kv_heads(f: Fields, heads: int, key: str = "num_key_value_heads") -> int:
    """``num_key_value_heads``, None meaning one per attention head (every family's ``__post_init__``)."""
    kv = f.int(key, allow_none=True)
    kv = heads if kv is None else kv
    if kv <= 0 or heads % kv:
        raise ValueError(f"config: {key}={kv} does not divide num_attention_heads={heads}")
    return kv


def gqa_attn_cfg(f: Fields, head_dim: int, rotary_dim: int, base: float, **extra) -> dict:
    """``attn_cfg`` for transformers' GQA attention: heads and KV heads, q/k/v/o biases from ``attention_bias``,
    RoPE."""
    heads = f.int("num_attention_heads")
    bias = f.bool("attention_bias")
    return {"num_heads": heads, "num_heads_kv": kv_heads(f, heads), "head_dim": head_dim, "qkv_proj_bias": bias,
            "out_proj_bias": bias, "rotary_emb_dim": rotary_dim, "rotary_emb_base": base, **extra}


def attention_head_dim(f: Fields) -> int:
    """``getattr(config, "head_dim", None) or hidden_size // num_attention_heads`` (Bamba, Granite, Falcon-H1)."""
    head_dim = f.int("head_dim", allow_none=True) if "head_dim" in f else None
    return head_dim or f.int("hidden_size") // f.int("num_attention_heads")


def mamba_head(f: Fields, d_ssm: int, ssm_width_key: str) -> int:
    """``mamba_d_head`` ("auto": ``d_ssm // mamba_n_heads``), checked to fill ``d_ssm`` as transformers requires."""
    n_heads = f.int("mamba_n_heads")
    d_head = f.get("mamba_d_head")
    d_head = d_ssm // n_heads if d_head in (None, "auto") else f.int("mamba_d_head")
    if d_head * n_heads != d_ssm:
        raise ValueError(f"config: mamba_n_heads*mamba_d_head {n_heads}*{d_head} != {ssm_width_key} {d_ssm}")
    return d_head


def mamba_ssm_cfg(f: Fields, expand, d_head: int, eps: float, **extra) -> dict:
    """``ssm_cfg`` from the ``mamba_*`` fields Bamba, GraniteMoeHybrid and Falcon-H1 share."""
    return {
        "d_state": f.int("mamba_d_state"), "d_conv": f.int("mamba_d_conv"), "expand": expand, "headdim": d_head,
        "ngroups": f.int("mamba_n_groups"), "bias": f.bool("mamba_proj_bias"), "conv_bias": f.bool("mamba_conv_bias"),
        "dt_limit": dt_limit(f), "chunk_size": f.int("mamba_chunk_size"), "norm_eps": eps, **extra,
    }


def swiglu_decoder_fields(f: Fields) -> dict:
    """``ModelConfig`` fields of a decoder whose every layer ends in a SwiGLU MLP of ``intermediate_size``
    (Bamba, Falcon-H1, MambaInLlama): width, depth, vocabulary, the MLP's biases."""
    return dict(d_model=f.int("hidden_size"), d_intermediate=f.int("intermediate_size"), mlp_multiple=1,
                n_layer=f.int("num_hidden_layers"), vocab_size=f.int("vocab_size"), mlp_bias=f.bool("mlp_bias"))
