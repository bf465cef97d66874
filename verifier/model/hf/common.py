"""Config checks shared by the Hugging Face families: refuse fields whose value would change the math."""

from __future__ import annotations


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
