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

from stree.verifier.model.config import ModelConfig, require_silu
from stree.verifier.model.hf.common import (gqa_attn_cfg, hf_norm_fields, mamba_ssm_cfg, refuse_unless,
                                             rope_settings, swiglu_decoder_fields)
from stree.verifier.model.hf.weights import layer_indices, swiglu_decoder_weights

MODEL_TYPE = "falcon_h1"
CLASS_NAME = "FalconH1ForCausalLM"


def _mamba_shape(data: dict) -> tuple[int, int, int, int]:
    """(SSM width, heads, head dim, groups*state) as FalconH1Config resolves them (its defaults included)."""
    d_model = int(data["hidden_size"])
    d_ssm = data.get("mamba_d_ssm", 1024)
    d_ssm = int(data.get("mamba_expand", 2) * d_model) if d_ssm is None else int(d_ssm)
    n_heads = int(data.get("mamba_n_heads", 128))
    d_head = data.get("mamba_d_head", "auto")
    d_head = d_ssm // n_heads if d_head in (None, "auto") else int(d_head)
    if d_head * n_heads != d_ssm:
        raise ValueError(f"config: mamba_n_heads*mamba_d_head {n_heads * d_head} != mamba_d_ssm {d_ssm}")
    return d_ssm, n_heads, d_head, int(data.get("mamba_n_groups", 1)) * int(data.get("mamba_d_state", 256))


def config(data: dict) -> ModelConfig:
    require_silu(data, "hidden_act")  # the Mamba conv/gate activation and the MLP's
    refuse_unless(data, "mlp_bias", False)
    for key, n in (("mlp_multipliers", 2), ("ssm_multipliers", 5)):
        if data.get(key) is not None and len(data[key]) != n:
            raise ValueError(f"config: {key}={data[key]!r} must hold {n} values")
    d_model = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    head_dim = int(data.get("head_dim") or d_model // heads)
    _, base = rope_settings(data, head_dim)  # Falcon-H1's default RoPE rotates the whole head
    d_ssm, _, d_head, _ = _mamba_shape(data)
    eps = float(data.get("rms_norm_eps", 1e-5))
    n_layer = int(data["num_hidden_layers"])
    return ModelConfig(
        **swiglu_decoder_fields(data),
        ssm_cfg=mamba_ssm_cfg(
            data, d_ssm // d_model if d_ssm % d_model == 0 else d_ssm / d_model, d_head, eps,  # no MLP half
            # one flag for in_proj (mamba_proj_bias) and out_proj (projectors_bias); weights() zero-fills the other
            bias=bool(data.get("mamba_proj_bias", False)) or bool(data.get("projectors_bias", False)),
            rmsnorm=bool(data.get("mamba_rms_norm", False)),
            norm_before_gate=bool(data.get("mamba_norm_before_gate", True)),
        ),
        attn_layer_idx=list(range(n_layer)),
        parallel_mamba=True,
        attn_cfg=gqa_attn_cfg(data, head_dim, head_dim, base),
        embedding_multiplier=float(data.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(data.get("lm_head_multiplier", 1.0)),
        **hf_norm_fields(data, eps),
    )


def _mup_vector(data: dict) -> torch.Tensor:
    """Per-row scale of the Mamba in_proj output: ``ssm_multipliers`` over its z, x, B, C and dt parts."""
    d_ssm, n_heads, _, gs = _mamba_shape(data)
    mults = data.get("ssm_multipliers") or [1.0] * 5
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


def fold_multipliers(sd: dict, data: dict) -> None:
    """Fold the muP multipliers into the projections they scale (HF names, in place)."""
    mup = _mup_vector(data)
    ssm_in = float(data.get("ssm_in_multiplier", 1.0))
    attn_in = float(data.get("attention_in_multiplier", 1.0))
    key = float(data.get("key_multiplier", 1.0))
    gate_m, down_m = (float(m) for m in (data.get("mlp_multipliers") or [1.0, 1.0]))
    for i in layer_indices(sd, "model.layers"):
        p = f"model.layers.{i}"
        sd.pop(f"{p}.mamba.mup_vector", None)  # a buffer transformers recomputes from the config
        _scale(sd, f"{p}.mamba.in_proj.weight", mup * ssm_in)  # in_proj(x * ssm_in) * mup
        _scale(sd, f"{p}.mamba.in_proj.bias", mup)
        for kind in ("weight", "bias"):
            _scale(sd, f"{p}.mamba.out_proj.{kind}", float(data.get("ssm_out_multiplier", 1.0)))
            _scale(sd, f"{p}.self_attn.o_proj.{kind}", float(data.get("attention_out_multiplier", 1.0)))
        _scale(sd, f"{p}.self_attn.q_proj.weight", attn_in)
        _scale(sd, f"{p}.self_attn.v_proj.weight", attn_in)
        _scale(sd, f"{p}.self_attn.k_proj.weight", attn_in * key)  # k_proj(x * attn_in) * key
        _scale(sd, f"{p}.self_attn.k_proj.bias", key)
        _scale(sd, f"{p}.feed_forward.gate_proj.weight", gate_m)
        _scale(sd, f"{p}.feed_forward.down_proj.weight", down_m)


def weights(sd: dict, data: dict) -> dict:
    fold_multipliers(sd, data)
    sd = swiglu_decoder_weights(sd, "final_layernorm", "pre_ff_layernorm",
                                {"mamba": "mixer.mamba", "self_attn": "mixer.attn", "feed_forward": "feed_forward"},
                                attn=("mixer.attn", "mixer.attn"), mlp="feed_forward")
    if bool(data.get("mamba_proj_bias", False)) != bool(data.get("projectors_bias", False)):
        for i in layer_indices(sd, "backbone.layers"):
            for proj in ("in_proj", "out_proj"):  # the projection without a bias gets a zero one
                w = sd.get(f"backbone.layers.{i}.mixer.mamba.{proj}.weight")
                if w is not None:
                    sd.setdefault(f"backbone.layers.{i}.mixer.mamba.{proj}.bias",
                                  torch.zeros(w.shape[0], dtype=w.dtype))
    return sd
