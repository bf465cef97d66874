"""Zamba2 (``Zamba2ForCausalLM``): Mamba2 layers, some of them "hybrid": a shared transformer block runs first.

A hybrid layer computes ``t = linear(mlp(norm(attn(norm([h; emb])))))`` from the residual stream ``h`` and
the token embeddings ``emb``, then ``h + mamba(norm(h + t))`` (``SharedBlockMixer``). Zamba2 ties the block's
weights across hybrid layers (``num_mem_blocks`` distinct blocks, used in turn) and gives each use its own
LoRA adapters on q/k/v (``use_shared_attention_adapter``) and on the MLP's gate/up projection (always).
At load time every use gets its own copy of its block's weights with its adapters folded in
(``W + B @ A``, in float32), so each use is an ordinary attention layer with its own KV cache: exact, and
tree_forward / commit need nothing new.
"""

from __future__ import annotations

import math

import torch

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf.common import hf_norm_fields, map_layer_types, refuse_unless, rope_settings

MODEL_TYPE = "zamba2"
CLASS_NAME = "Zamba2ForCausalLM"
_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
_MAMBA_NORM_EPS = 1e-5  # Zamba2MambaMixer's gated norm has a fixed eps, not rms_norm_eps


def layer_kinds(data: dict) -> list[str]:
    raw = data.get("layers_block_type") or data.get("layer_types")
    if not raw:
        raise ValueError("config: Zamba2 needs layers_block_type")
    return map_layer_types(raw, _KINDS, "layers_block_type")


def config(data: dict) -> ModelConfig:
    act = data.get("hidden_act", "gelu")  # the shared MLP's activation (the Mamba2 mixer always uses SiLU)
    if act not in ("gelu", "silu", "swish"):
        raise ValueError(f"config: hidden_act={act!r} is not supported (only 'gelu' or 'silu')")
    refuse_unless(data, "add_bias_linear", False)
    d_model = int(data["hidden_size"])
    kinds = layer_kinds(data)
    heads = int(data["num_attention_heads"])
    kv_heads = int(data.get("num_key_value_heads") or heads)
    if (2 * d_model) % heads:
        raise ValueError(f"config: num_attention_heads={heads} does not divide attention_hidden_size {2 * d_model}")
    head_dim = 2 * d_model // heads  # Zamba2 derives it; a stored attention_head_dim is recomputed the same way
    if bool(data.get("use_shared_attention_adapter", False)) and kv_heads != heads:
        raise ValueError(f"config: num_key_value_heads={kv_heads} with use_shared_attention_adapter is not supported "
                         f"(the k/v adapters are {2 * d_model} wide)")
    expand = data.get("mamba_expand", 2)
    d_ssm = int(expand * d_model)
    n_heads = int(data.get("n_mamba_heads", 8))
    if d_ssm % n_heads or abs(d_ssm - expand * d_model) > 1e-6:
        raise ValueError(f"config: mamba_expand*hidden_size {expand * d_model} does not split into "
                         f"n_mamba_heads={n_heads} heads")
    if bool(data.get("use_mem_rope", False)):
        _, base = rope_settings(data, head_dim)  # refuses any rope_type but 'default'; the whole head rotates
        rotary_dim = head_dim
    else:
        rotary_dim, base = 0, 10000.0
    eps = float(data.get("rms_norm_eps", 1e-5))
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=int(data["vocab_size"]),
        ssm_cfg={
            "d_state": int(data.get("mamba_d_state", 64)), "d_conv": int(data.get("mamba_d_conv", 4)),
            "expand": d_ssm // d_model if d_ssm % d_model == 0 else d_ssm / d_model, "headdim": d_ssm // n_heads,
            "ngroups": int(data.get("mamba_ngroups", 1)), "bias": False,
            "conv_bias": True,  # Zamba2's conv1d always has a bias (use_conv_bias is not read)
            "dt_limit": [float(data.get("time_step_min", 0.001)), math.inf],
            "chunk_size": int(data.get("chunk_size", 256)), "norm_eps": _MAMBA_NORM_EPS,
        },
        attn_cfg={"num_heads": heads, "num_heads_kv": kv_heads, "head_dim": head_dim, "qkv_proj_bias": False,
                  "out_proj_bias": False, "softmax_scale": (head_dim / 2) ** -0.5, "rotary_emb_dim": rotary_dim,
                  "rotary_emb_base": base},
        hybrid_layer_idx=[i for i, k in enumerate(kinds) if k == "hybrid"],
        hybrid_mlp={"hidden": int(data.get("intermediate_size") or 4 * d_model),
                    "act": "silu" if act == "swish" else act},
        **{**hf_norm_fields(data, eps), "tie_embeddings": bool(data.get("tie_word_embeddings", True))},
    )


def _folded(take, base: str, adapter: str | None) -> torch.Tensor:
    """``take(base)`` plus the LoRA product ``B @ A`` of ``{adapter}.0`` (A) and ``{adapter}.1`` (B), in float32."""
    w = take(base)
    if adapter is None:
        return w
    a, b = take(f"{adapter}.0.weight").float(), take(f"{adapter}.1.weight").float()
    return (w.float() + b @ a).to(w.dtype)


def weights(sd: dict, data: dict) -> dict:
    kinds = layer_kinds(data)
    hybrid = [i for i, k in enumerate(kinds) if k == "hybrid"]
    n_mem = int(data.get("num_mem_blocks", 1))
    q_adapters = bool(data.get("use_shared_attention_adapter", False))
    out: dict = {}
    used: set = set()

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"weights: the {CLASS_NAME} checkpoint has no tensor {name}")
        used.add(name)
        return sd[name]

    def move(src: str, dst: str) -> None:
        for name in [n for n in sd if n.startswith(src + ".")]:
            out[dst + name[len(src):]] = take(name)

    move("model.embed_tokens", "backbone.embedding")
    move("model.final_layernorm", "backbone.norm_f")
    for i, kind in enumerate(kinds):
        p, dst = f"model.layers.{i}", f"backbone.layers.{i}"
        if kind == "mamba":
            move(f"{p}.mamba", f"{dst}.mixer")
            move(f"{p}.input_layernorm", f"{dst}.norm")
            continue
        move(f"{p}.mamba_decoder.mamba", f"{dst}.mixer.mamba")
        move(f"{p}.mamba_decoder.input_layernorm", f"{dst}.mixer.mamba_norm")
        move(f"{p}.linear", f"{dst}.mixer.linear")
        use = hybrid.index(i)
        # this use's block: its own copy when saved, else the first layer that uses the same block (tied)
        own, first = f"{p}.shared_transformer", f"model.layers.{hybrid[use % n_mem]}.shared_transformer"
        src = own if f"{own}.self_attn.q_proj.weight" in sd else first
        attn, ff = f"{src}.self_attn", f"{src}.feed_forward"
        qkv = [_folded(take, f"{attn}.{x}_proj.weight", f"{attn}.linear_{x}_adapter_list.{use}" if q_adapters else None)
               for x in "qkv"]
        out[f"{dst}.mixer.attn.in_proj.weight"] = torch.cat(qkv, dim=0)
        out[f"{dst}.mixer.attn.out_proj.weight"] = take(f"{attn}.o_proj.weight")
        out[f"{dst}.mixer.attn_norm.weight"] = take(f"{src}.input_layernorm.weight")
        out[f"{dst}.mixer.ff_norm.weight"] = take(f"{src}.pre_ff_layernorm.weight")
        out[f"{dst}.mixer.gate_up_proj.weight"] = _folded(take, f"{ff}.gate_up_proj.weight",
                                                      f"{ff}.gate_up_proj_adapter_list.{use}")
        out[f"{dst}.mixer.down_proj.weight"] = take(f"{ff}.down_proj.weight")
    for name, t in sd.items():
        if name in used:
            continue
        if ".shared_transformer." in name and "_adapter_list." in name:
            continue  # another use's adapter in a saved copy of a tied block: that use read it from its own source
        out[name] = t  # lm_head.weight, or a tensor nothing here reads: the loader names it as unexpected
    return out
