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
from stree.verifier.model.hf.common import ROPE_KEYS, default_rope, hf_norm_fields, kv_heads, map_layer_types
from stree.verifier.model.hf.fields import (DECODER_IGNORED, GENERATION, INIT, NUMERICS, TRAINING, ConfigSpec,
                                            warn_unread)

MODEL_TYPE = "zamba2"
CLASS_NAME = "Zamba2ForCausalLM"
_KINDS = {"linear_attention": "mamba", "hybrid": "hybrid"}
_MAMBA_NORM_EPS = 1e-5  # Zamba2MambaMixer's gated norm has a fixed eps, not rms_norm_eps
_DEFAULT_LAYERS = (["linear_attention"] + (["linear_attention"] * 5 + ["hybrid"]) * 7 + ["linear_attention"] * 4
                   + ["hybrid"] + ["linear_attention"] * 3 + ["hybrid"] + ["linear_attention"] * 2)

SPEC = ConfigSpec(
    class_name="Zamba2Config",
    defaults={
        "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_size": 2560, "num_hidden_layers": 54,
        "layers_block_type": None, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "n_mamba_heads": 8,
        "use_mamba_kernels": True, "use_conv_bias": True, "chunk_size": 256, "use_mem_eff_path": False,
        "add_bias_linear": False, "intermediate_size": None, "hidden_act": "gelu", "num_attention_heads": 32,
        "num_key_value_heads": None, "attention_dropout": 0.0, "num_mem_blocks": 1,
        "use_shared_attention_adapter": False, "adapter_rank": 128, "use_mem_rope": False, "rope_parameters": None,
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "num_logits_to_keep": 1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_long_context": False,
        "tie_word_embeddings": True,
    },
    ignored={
        **DECODER_IGNORED, "time_step_max": INIT, "time_step_floor": INIT, "use_mamba_kernels": TRAINING,
        "use_conv_bias": "Zamba2's Mamba conv always has a bias", "chunk_size": NUMERICS,
        "use_mem_eff_path": TRAINING, "adapter_rank": "the adapters' shape, read from the weights",
        "num_logits_to_keep": GENERATION,
        "use_long_context": "only sets max_position_embeddings, which plain RoPE does not read",
    },
    # derived by Zamba2Config and saved; a stored value overrides the derived one (set after __post_init__)
    optional={"attention_head_dim": None, "head_dim": None, "attention_hidden_size": None, "mamba_headdim": None,
              "hybrid_layer_ids": None, "layer_types": None, **ROPE_KEYS},
    extra_ignored=frozenset({"kv_channels", "num_query_groups"}),  # derived, not read by the model
)


def layer_kinds(f) -> list[str]:
    raw = f["layer_types"] if f.get("layer_types") is not None else f.get("layers_block_type")
    return map_layer_types(_DEFAULT_LAYERS if raw is None else raw, _KINDS, "layers_block_type")


def _stored(f, key: str, derived: int) -> int:
    """A derived size as the model reads it: ``key``'s stored value when config.json has one."""
    return derived if f.get(key) is None else f.int(key)


def _head_dim(f, d_model: int, heads: int) -> int:
    if f.get("attention_head_dim") is not None and f.get("head_dim") is not None and \
            f["attention_head_dim"] != f["head_dim"]:
        raise ValueError(f"config: attention_head_dim={f['attention_head_dim']} and head_dim={f['head_dim']} differ")
    key = "attention_head_dim" if f.get("attention_head_dim") is not None else "head_dim"
    return _stored(f, key, 2 * d_model // heads)


def config(f) -> ModelConfig:
    f.refuse_unless("hidden_act", "gelu", "silu", "swish")  # the shared MLP's (the Mamba2 mixer always uses SiLU)
    d_model = f.int("hidden_size")
    kinds = layer_kinds(f)
    if f.int("num_hidden_layers") != len(kinds):  # transformers' validation refuses this too
        raise ValueError(f"config: num_hidden_layers={f['num_hidden_layers']} is not the {len(kinds)} entries of "
                         "layers_block_type")
    hybrid = [i for i, k in enumerate(kinds) if k == "hybrid"]
    if f.get("hybrid_layer_ids") is not None and list(f["hybrid_layer_ids"]) != hybrid:
        raise ValueError(f"config: hybrid_layer_ids={f['hybrid_layer_ids']} are not the hybrid layers {hybrid} "
                         "of layers_block_type")
    if _stored(f, "attention_hidden_size", 2 * d_model) != 2 * d_model:
        raise ValueError(f"config: attention_hidden_size={f['attention_hidden_size']} is not 2*hidden_size "
                         f"{2 * d_model} (the attention reads [hidden; embeddings])")
    heads = f.int("num_attention_heads")
    kv = kv_heads(f, heads)
    head_dim = _head_dim(f, d_model, heads)
    if f.bool("use_shared_attention_adapter") and (heads * head_dim != 2 * d_model or kv != heads):
        raise ValueError(f"config: num_attention_heads={heads}, num_key_value_heads={kv} and head dim {head_dim} "
                         f"with use_shared_attention_adapter: the q/k/v adapters are {2 * d_model} wide, so "
                         "transformers cannot run this either")
    d_ssm = f.int("mamba_expand") * d_model
    n_heads = f.int("n_mamba_heads")
    mamba_headdim = _stored(f, "mamba_headdim", d_ssm // n_heads)
    if n_heads * mamba_headdim != d_ssm:
        raise ValueError(f"config: n_mamba_heads*mamba_headdim {n_heads}*{mamba_headdim} != mamba_expand*hidden_size "
                         f"{d_ssm}")
    rotary_dim, base = default_rope(f, head_dim, honour_partial=False) if f.bool("use_mem_rope") else (0, 10000.0)
    eps = f.float("rms_norm_eps")
    bias = f.bool("add_bias_linear")
    act = "silu" if f["hidden_act"] == "swish" else f["hidden_act"]
    return ModelConfig(
        d_model=d_model,
        n_layer=len(kinds),
        vocab_size=f.int("vocab_size"),
        ssm_cfg={
            "d_state": f.int("mamba_d_state"), "d_conv": f.int("mamba_d_conv"), "expand": f.int("mamba_expand"),
            "headdim": mamba_headdim, "ngroups": f.int("mamba_ngroups"), "bias": bias,
            "conv_bias": True, "dt_limit": [f.float("time_step_min"), math.inf],
            "chunk_size": f.int("chunk_size"), "norm_eps": _MAMBA_NORM_EPS,
        },
        attn_cfg={"num_heads": heads, "num_heads_kv": kv, "head_dim": head_dim, "qkv_proj_bias": False,
                  "out_proj_bias": False, "softmax_scale": (head_dim / 2) ** -0.5, "rotary_emb_dim": rotary_dim,
                  "rotary_emb_base": base},
        hybrid_layer_idx=hybrid,
        hybrid_mlp={"hidden": _stored(f, "intermediate_size", 4 * d_model), "act": act, "bias": bias},
        **hf_norm_fields(f, eps),
    )


def weights(sd: dict, f) -> dict:
    """Per hybrid layer, each shared-block tensor is the layer's own saved copy when the checkpoint has one (a
    copy transformers leaves untied), else the copy of the first layer using the same block (tied to it)."""
    kinds = layer_kinds(f)
    hybrid = [i for i, k in enumerate(kinds) if k == "hybrid"]
    n_mem = f.int("num_mem_blocks")
    q_adapters = f.bool("use_shared_attention_adapter")
    out: dict = {}
    used: set = set()

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"weights: the {CLASS_NAME} checkpoint has no tensor {name}")
        used.add(name)
        return sd[name]

    def shared(layer: int, rel: str) -> str:
        """The name of the shared-block tensor ``rel`` hybrid layer ``layer`` runs with."""
        own = f"model.layers.{layer}.shared_transformer.{rel}"
        return own if own in sd else f"model.layers.{hybrid[hybrid.index(layer) % n_mem]}.shared_transformer.{rel}"

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
        at = lambda rel: take(shared(i, rel))  # noqa: E731
        qkv = []
        for x in "qkv":
            w = at(f"self_attn.{x}_proj.weight")
            if q_adapters:
                a = at(f"self_attn.linear_{x}_adapter_list.{use}.0.weight").float()
                b = at(f"self_attn.linear_{x}_adapter_list.{use}.1.weight").float()
                w = (w.float() + b @ a).to(w.dtype)
            qkv.append(w)
        out[f"{dst}.mixer.attn.in_proj.weight"] = torch.cat(qkv, dim=0)
        out[f"{dst}.mixer.attn.out_proj.weight"] = at("self_attn.o_proj.weight")
        out[f"{dst}.mixer.attn_norm.weight"] = at("input_layernorm.weight")
        out[f"{dst}.mixer.ff_norm.weight"] = at("pre_ff_layernorm.weight")
        w = at("feed_forward.gate_up_proj.weight")
        a = at(f"feed_forward.gate_up_proj_adapter_list.{use}.0.weight").float()
        b = at(f"feed_forward.gate_up_proj_adapter_list.{use}.1.weight").float()
        out[f"{dst}.mixer.gate_up_proj.weight"] = (w.float() + b @ a).to(w.dtype)
        out[f"{dst}.mixer.down_proj.weight"] = at("feed_forward.down_proj.weight")
        for proj in ("gate_up_proj", "down_proj"):  # add_bias_linear
            if shared(i, f"feed_forward.{proj}.bias") in sd:
                out[f"{dst}.mixer.{proj}.bias"] = at(f"feed_forward.{proj}.bias")
    dead = []
    for name, t in sd.items():
        if name in used:
            continue
        rel = name.split(".shared_transformer.", 1)[1] if ".shared_transformer." in name else None
        adapter_use = _adapter_use(rel) if rel is not None else None
        if adapter_use is not None and adapter_use < len(hybrid):
            # another use's adapter in a copy of its block: transformers never runs it; equal to what that use runs?
            if not torch.equal(t, sd[shared(hybrid[adapter_use], rel)]):
                dead.append(name)
            continue
        out[name] = t  # lm_head.weight, or a tensor nothing here reads: the loader names it as unexpected
    warn_unread(dead, "another use's LoRA adapter in a saved copy of a shared block, which no layer runs "
                      "(transformers neither); it differs from the one that use runs")
    return out


def _adapter_use(rel: str) -> int | None:
    """The use index ``u`` of a ``..._adapter_list.{u}...`` tensor name, else None."""
    parts = rel.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.endswith("_adapter_list") and parts[k + 1].isdigit():
            return int(parts[k + 1])
    return None
