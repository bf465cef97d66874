"""Falcon-H1 (``FalconH1ForCausalLM``): Mamba2 and GQA attention with RoPE side by side in every layer, then a SwiGLU MLP.

Both halves read the same normed input and their outputs are summed before the residual add
(``ModelConfig.parallel_mamba``). The muP multipliers that scale a projection's input or output
(``ssm_in_multiplier`` and the ``ssm_multipliers`` mup vector on the Mamba in_proj, ``ssm_out_multiplier``,
``attention_in_multiplier``, ``key_multiplier``, ``attention_out_multiplier``, ``mlp_multipliers``) are
folded into those projections' weights at load time (in float32, then cast back); ``embedding_multiplier``
and ``lm_head_multiplier`` act on the embedding output and the logits.
"""

from __future__ import annotations

import torch

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import (MAMBA_DECODER_DEFAULTS, ROPE_KEYS, attention_head_dim, default_rope,
                                            gqa_attn_cfg, hf_norm_fields, mamba_head, mamba_ssm_cfg,
                                            swiglu_decoder_fields)
from stree.verifier.model.hf.fields import DECODER_IGNORED, GENERATION, NUMERICS, ConfigSpec, warn_unread
from stree.verifier.model.hf.weights import layer_indices, swiglu_decoder_weights

MODEL_TYPE = "falcon_h1"
CLASS_NAME = "FalconH1ForCausalLM"

SPEC = ConfigSpec(
    class_name="FalconH1Config",
    defaults={
        **MAMBA_DECODER_DEFAULTS, "max_position_embeddings": 8192, "mamba_d_ssm": 1024,
        "mamba_norm_before_gate": True, "mamba_rms_norm": False, "projectors_bias": False, "lm_head_multiplier": 1.0,
        "embedding_multiplier": 1.0, "mlp_multipliers": None, "key_multiplier": 1.0, "attention_out_multiplier": 1.0,
        "attention_in_multiplier": 1.0, "ssm_multipliers": None, "ssm_in_multiplier": 1.0, "ssm_out_multiplier": 1.0,
    },
    ignored={**DECODER_IGNORED, "num_logits_to_keep": GENERATION, "mamba_chunk_size": NUMERICS},
    optional={"head_dim": None, **ROPE_KEYS},
    extra_ignored=frozenset({"layers_block_type", "layer_types"}),  # derived: every layer is a hybrid
)


def _mamba_shape(f) -> tuple[int, int, int, int]:
    """(SSM width, heads, head dim, groups*state) as FalconH1Config resolves them."""
    d_ssm = f.int("mamba_d_ssm", allow_none=True)
    d_ssm = f.int("mamba_expand") * f.int("hidden_size") if d_ssm is None else d_ssm
    return d_ssm, f.int("mamba_n_heads"), mamba_head(f, d_ssm, "mamba_d_ssm"), f.int("mamba_n_groups") * f.int(
        "mamba_d_state")


def _multipliers(f, key: str, n: int) -> list[float]:
    value = f.get(key)
    if value is None:
        return [1.0] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"config: {key}={value!r} must hold {n} values")
    return [float(v) for v in value]


def config(f) -> ModelConfig:
    f.refuse_unless("hidden_act", "silu", "swish")  # the Mamba conv/gate activation and the MLP's
    _multipliers(f, "mlp_multipliers", 2)
    _multipliers(f, "ssm_multipliers", 5)
    d_model = f.int("hidden_size")
    head_dim = attention_head_dim(f)
    _, base = default_rope(f, head_dim, honour_partial=False)  # Falcon-H1's RoPE rotates the whole head
    d_ssm, _, d_head, _ = _mamba_shape(f)
    eps = f.float("rms_norm_eps")
    return ModelConfig(
        **swiglu_decoder_fields(f),
        ssm_cfg=mamba_ssm_cfg(
            f, d_ssm // d_model if d_ssm % d_model == 0 else d_ssm / d_model, d_head, eps,  # no MLP half
            # one flag for in_proj (mamba_proj_bias) and out_proj (projectors_bias); weights() zero-fills the other
            bias=f.bool("mamba_proj_bias") or f.bool("projectors_bias"),
            rmsnorm=f.bool("mamba_rms_norm"),
            norm_before_gate=f.bool("mamba_norm_before_gate"),
        ),
        attn_layer_idx=list(range(f.int("num_hidden_layers"))),
        parallel_mamba=True,
        attn_cfg=gqa_attn_cfg(f, head_dim, head_dim, base),
        embedding_multiplier=f.float("embedding_multiplier"),
        logits_scaling=1.0 / f.float("lm_head_multiplier"),
        **hf_norm_fields(f, eps),
    )


def _mup_vector(f) -> torch.Tensor:
    """Per-row scale of the Mamba in_proj output: ``ssm_multipliers`` over its z, x, B, C and dt parts."""
    d_ssm, n_heads, _, gs = _mamba_shape(f)
    mults = _multipliers(f, "ssm_multipliers", 5)
    sizes = [d_ssm, d_ssm, gs, gs, n_heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, mults)])


def _scale(sd: dict, name: str, factor) -> None:
    """Multiply ``sd[name]`` (when present) by ``factor`` (a scalar, or a per-row vector) in float32."""
    if name not in sd:
        return
    t = sd[name]
    f = torch.as_tensor(factor, dtype=torch.float32)
    f = f.reshape(-1, *([1] * (t.dim() - 1))) if f.dim() else f
    sd[name] = (t.float() * f).to(t.dtype)


def _drop_saved_mup_vectors(sd: dict, mup: torch.Tensor) -> None:
    """Older releases saved each layer's mup vector; transformers now recomputes it from ``ssm_multipliers``.
    A saved one equal to that is dropped silently, any other is named in a warning (transformers ignores it)."""
    saved = [k for k in sd if k.endswith(".mamba.mup_vector")]
    differ = [k for k in saved if not torch.equal(sd[k].float().reshape(-1), mup)]
    for k in saved:
        del sd[k]
    warn_unread(differ, "they differ from the ssm_multipliers vector, which transformers uses instead")


def fold_multipliers(sd: dict, f) -> None:
    """Fold the muP multipliers into the projections they scale (HF names, in place)."""
    mup = _mup_vector(f)
    _drop_saved_mup_vectors(sd, mup)
    ssm_in = f.float("ssm_in_multiplier")
    attn_in = f.float("attention_in_multiplier")
    key = f.float("key_multiplier")
    gate_m, down_m = _multipliers(f, "mlp_multipliers", 2)
    for i in layer_indices(sd, "model.layers"):
        p = f"model.layers.{i}"
        _scale(sd, f"{p}.mamba.in_proj.weight", mup * ssm_in)  # in_proj(x * ssm_in) * mup
        _scale(sd, f"{p}.mamba.in_proj.bias", mup)
        for kind in ("weight", "bias"):
            _scale(sd, f"{p}.mamba.out_proj.{kind}", f.float("ssm_out_multiplier"))
            _scale(sd, f"{p}.self_attn.o_proj.{kind}", f.float("attention_out_multiplier"))
        _scale(sd, f"{p}.self_attn.q_proj.weight", attn_in)
        _scale(sd, f"{p}.self_attn.v_proj.weight", attn_in)
        _scale(sd, f"{p}.self_attn.k_proj.weight", attn_in * key)  # k_proj(x * attn_in) * key
        _scale(sd, f"{p}.self_attn.k_proj.bias", key)
        for kind in ("weight", "bias"):  # act(gate_proj(x) * gate_m), down_proj(y) * down_m
            _scale(sd, f"{p}.feed_forward.gate_proj.{kind}", gate_m)
            _scale(sd, f"{p}.feed_forward.down_proj.{kind}", down_m)


def weights(sd: dict, f) -> dict:
    fold_multipliers(sd, f)
    sd = swiglu_decoder_weights(sd, "final_layernorm", "pre_ff_layernorm",
                                {"mamba": "mixer.mamba", "self_attn": "mixer.attn", "feed_forward": "feed_forward"},
                                attn=("mixer.attn", "mixer.attn"), mlp="feed_forward")
    if f.bool("mamba_proj_bias") != f.bool("projectors_bias"):
        for i in layer_indices(sd, "backbone.layers"):
            for proj in ("in_proj", "out_proj"):  # the projection without a bias gets a zero one
                w = sd.get(f"backbone.layers.{i}.mixer.mamba.{proj}.weight")
                if w is not None:
                    sd.setdefault(f"backbone.layers.{i}.mixer.mamba.{proj}.bias",
                                  torch.zeros(w.shape[0], dtype=w.dtype))
    return sd
