"""MambaInLlama (github.com/jxiw/MambaInLlama, ``mamba2/``): a Llama whose listed layers hold a Mamba2 mixer.

On disk: the Llama's ``config.json`` (``LlamaForCausalLM``, ``model_type`` ``llama``), a ``mamba_config.json``
beside it (``d_model``, ``d_inner``, ``d_xb``, ``ssm_cfg``, ``attn_layers``, ``n_layer``, ``intermediate_size``,
``rms_norm_eps``, ...) and the LlamaForCausalLM state dict, where a Mamba layer ``i`` keeps
``model.layers.{i}.{input_layernorm,post_attention_layernorm,mlp}`` and has ``model.layers.{i}.mamba.*``
(mamba_ssm's Mamba2 names) instead of ``self_attn``.

Their Mamba2 has ``ngroups`` heads of size ``d_state`` (``d_inner = ngroups * d_state``) and every head owns its
C, but x and B come from only ``d_xb`` in_proj rows: ``d_xb / d_state`` shared groups, group ``g`` serving heads
``g*r .. g*r+r-1`` (``r = d_inner / d_xb``, like repeated K/V heads). The conv is depthwise and SiLU acts per
channel, so repeating those in_proj rows (and their conv channels) per head at load time gives exactly the same
outputs; the plain Mamba2 mixer (one B/C group per head) then runs it, tree scan and replay included.
"""

from __future__ import annotations

import torch

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import (LLAMA_DEFAULTS, ROPE_KEYS, default_rope, gqa_attn_cfg, hf_norm_fields,
                                            swiglu_decoder_fields)
from stree.verifier.model.hf.fields import DECODER_IGNORED, ConfigSpec, Fields, dt_limit
from stree.verifier.model.hf.weights import layer_indices, swiglu_decoder_weights

MODEL_TYPE = "llama"
CLASS_NAME = "LlamaForCausalLM with mamba_config.json (MambaInLlama Mamba2 hybrid)"
MAMBA_CONFIG_FILE = "mamba_config.json"
MAMBA_CONFIG_KEY = "__mamba_config__"  # where checkpoint.py puts the parsed mamba_config.json

# the Llama side of config.json, read as transformers' LlamaConfig
SPEC = ConfigSpec(
    class_name="LlamaConfig",
    defaults={**LLAMA_DEFAULTS, "pretraining_tp": 1, "mlp_bias": False, "head_dim": None},
    ignored={**DECODER_IGNORED, "pretraining_tp": "transformers 5 computes the same projections unsplit"},
    optional={MAMBA_CONFIG_KEY: None, **ROPE_KEYS},
)
# mamba_config.json's keys: the fields of their MambaConfig dataclass (which refuses any other key)
_MAMBA_CONFIG_KEYS = {"d_model", "ssm_cfg", "rms_norm_eps", "vocab_size", "d_inner", "d_xb", "intermediate_size",
                      "hidden_act", "n_layer", "attn_layers"}

# ssm_cfg keys that change nothing at inference time (initialisation, training kernels, or replaced by d_state)
_IGNORED = {"conv_init", "A_init_range", "dt_min", "dt_max", "dt_init_floor", "use_mem_eff_path",
            "sequence_parallel", "process_group", "layer_idx", "expand", "headdim", "d_ssm",
            "repeat_kv_before_conv"}
_PASSED = {"d_conv", "D_has_hdim", "rmsnorm", "norm_before_gate", "dt_limit", "bias", "conv_bias", "chunk_size"}


def _shapes(data: dict) -> tuple[dict, int, int, int, int]:
    """(their mamba config, d_inner, d_xb, d_state, heads), checked against the Mamba2 layer's own asserts."""
    mc = data.get(MAMBA_CONFIG_KEY)
    if not isinstance(mc, dict):
        raise ValueError(f"LlamaForCausalLM is only supported as a MambaInLlama hybrid (needs {MAMBA_CONFIG_FILE} "
                         "beside config.json); plain Llama checkpoints are not supported")
    ssm = dict(mc.get("ssm_cfg") or {})
    unknown = sorted(set(ssm) - _IGNORED - _PASSED - {"d_state", "ngroups"})
    if unknown:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: ssm_cfg keys {unknown} are not supported")
    unknown = sorted(set(mc) - _MAMBA_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: keys {unknown} are not supported")
    d_model = int(mc.get("d_model", 2560))
    d_state = int(ssm.get("d_state", 128))
    heads = int(ssm.get("ngroups", 1))
    d_inner = mc.get("d_inner")
    d_inner = int(d_inner) if d_inner is not None else int(ssm.get("expand", 2)) * d_model
    d_xb = int(mc.get("d_xb", 2560))
    if ssm.get("d_ssm") is not None and int(ssm["d_ssm"]) != d_inner:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: ssm_cfg.d_ssm {ssm['d_ssm']} != d_inner {d_inner}")
    if d_inner != heads * d_state:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: d_inner {d_inner} != ssm_cfg.ngroups*d_state {heads * d_state} "
                         "(only the Mamba2 variant is supported, not MambaInLlama's Mamba1 layers)")
    if d_xb % d_state or d_inner % d_xb:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: d_xb {d_xb} must be a multiple of d_state {d_state} "
                         f"and divide d_inner {d_inner}")
    return mc, d_inner, d_xb, d_state, heads


def config(f: Fields) -> ModelConfig:
    mc, d_inner, d_xb, d_state, heads = _shapes(f)
    f.refuse_unless("hidden_act", "silu", "swish")
    Fields(mc, MAMBA_CONFIG_FILE).refuse_unless("hidden_act", None, "silu", "swish")
    d_model = f.int("hidden_size")
    n_layer = f.int("num_hidden_layers")
    for ours, theirs in (("d_model", d_model), ("n_layer", n_layer), ("intermediate_size", f.int("intermediate_size"))):
        if ours in mc and int(mc[ours]) != theirs:
            raise ValueError(f"{MAMBA_CONFIG_FILE}: {ours} {mc[ours]} differs from config.json's {theirs}")
    eps = f.float("rms_norm_eps")
    if "rms_norm_eps" in mc and float(mc["rms_norm_eps"]) != eps:
        raise ValueError(f"{MAMBA_CONFIG_FILE}: rms_norm_eps {mc['rms_norm_eps']} differs from config.json's {eps}")
    head_dim = f.int("head_dim", allow_none=True) or d_model // f.int("num_attention_heads")
    rotary_dim, base = default_rope(f, head_dim, honour_partial=False)  # Llama's RoPE rotates the whole head
    ssm = dict(mc.get("ssm_cfg") or {})
    ssm_cfg = {k: ssm[k] for k in _PASSED if k in ssm}
    if "dt_limit" in ssm_cfg:
        ssm_cfg["dt_limit"] = dt_limit(Fields(ssm_cfg, MAMBA_CONFIG_FILE), "dt_limit")
    # one B/C group per head once x and B are expanded; their gated norm's eps is fixed at 1e-5
    ssm_cfg.update(d_state=d_state, ngroups=heads, headdim=d_state, expand=d_inner / d_model, norm_eps=1e-5)
    attn_layers = sorted(int(i) for i in (mc.get("attn_layers") or []))
    return ModelConfig(
        **swiglu_decoder_fields(f),
        ssm_cfg=ssm_cfg,
        attn_layer_idx=attn_layers,
        attn_cfg=gqa_attn_cfg(f, head_dim, rotary_dim, base),
        **hf_norm_fields(f, eps),
    )


def _expand_rows(t: torch.Tensor, start: int, d_xb: int, d_state: int, r: int) -> torch.Tensor:
    """Rows ``start:start+d_xb`` (``d_xb/d_state`` groups of ``d_state``) repeated ``r`` times per group, in place."""
    part = t[start:start + d_xb]
    groups = part.reshape(d_xb // d_state, d_state, *part.shape[1:])
    wide = groups.repeat_interleave(r, dim=0).reshape(d_xb * r, *part.shape[1:])
    return torch.cat([t[:start], wide, t[start + d_xb:]], dim=0)


def weights(sd: dict, data: dict) -> dict:
    mc, d_inner, d_xb, d_state, _ = _shapes(data)
    if any(".mamba.in_proj_x." in k for k in sd):
        raise ValueError("MambaInLlama's Mamba1 layers (mamba.in_proj_x, B_proj, dt_proj) are not supported, "
                         "only its Mamba2 variant")
    r = d_inner // d_xb
    conv_done = bool((mc.get("ssm_cfg") or {}).get("repeat_kv_before_conv", False))
    sd = swiglu_decoder_weights(sd, "norm", "post_attention_layernorm",
                                {"mamba": "mixer", "self_attn": "self_attn", "mlp": "mlp"},
                                attn=("self_attn", "mixer"), mlp="mlp")
    for i in layer_indices(sd, "backbone.layers"):
        layer = f"backbone.layers.{i}"
        if r == 1 or f"{layer}.mixer.conv1d.weight" not in sd:
            continue
        # in_proj rows: [z d_inner | x d_xb | B d_xb | C d_inner | dt heads]; expand B first, then x
        for kind in ("weight", "bias"):
            name = f"{layer}.mixer.in_proj.{kind}"
            if name in sd:
                sd[name] = _expand_rows(sd[name], d_inner + d_xb, d_xb, d_state, r)
                sd[name] = _expand_rows(sd[name], d_inner, d_xb, d_state, r)
        if not conv_done:  # conv channels: [x d_xb | B d_xb | C d_inner]
            for kind in ("weight", "bias"):
                name = f"{layer}.mixer.conv1d.{kind}"
                if name in sd:
                    sd[name] = _expand_rows(sd[name], d_xb, d_xb, d_state, r)
                    sd[name] = _expand_rows(sd[name], 0, d_xb, d_state, r)
    return sd
