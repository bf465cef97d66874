"""Weight-renaming helpers shared by the Hugging Face families (prefix renames, fused q/k/v and MLP halves)."""

from __future__ import annotations

import re

import torch


def rename(sd: dict, rules: list[tuple[str, str]]) -> dict:
    """Apply the first matching ``(regex, replacement)`` rule to every name; names no rule matches stay."""
    out = {}
    for name, t in sd.items():
        for pattern, repl in rules:
            new, n = re.subn(pattern, repl, name)
            if n:
                name = new
                break
        out[name] = t
    return out


def decoder_rules(final_norm: str, norm2: str, sublayers: dict[str, str]) -> list[tuple[str, str]]:
    """``rename`` rules for a transformers decoder (``model.embed_tokens``, ``model.{final_norm}``, per layer
    ``input_layernorm`` and ``{norm2}``), with each layer's ``{src}.`` sub-module moved to ``{dst}.``."""
    layer = r"^model\.layers\.(\d+)\."
    return [
        (r"^model\.embed_tokens\.", "backbone.embedding."),
        (rf"^model\.{final_norm}\.", "backbone.norm_f."),
        (layer + r"input_layernorm\.", r"backbone.layers.\1.norm."),
        (layer + rf"{norm2}\.", r"backbone.layers.\1.norm2."),
    ] + [(layer + re.escape(src) + r"\.", rf"backbone.layers.\1.{dst}.") for src, dst in sublayers.items()]


def fuse(sd: dict, parts: list[str], target: str) -> None:
    """Concatenate ``parts`` (full names, in order) along dim 0 into ``target``, in place, when all are present."""
    if all(p in sd for p in parts):
        sd[target] = torch.cat([sd.pop(p) for p in parts], dim=0)


def fuse_attention(sd: dict, src: str, dst: str) -> None:
    """q/k/v projections at ``src`` -> one ``in_proj`` at ``dst``; ``o_proj`` -> ``out_proj``."""
    for kind in ("weight", "bias"):
        fuse(sd, [f"{src}.{p}_proj.{kind}" for p in "qkv"], f"{dst}.in_proj.{kind}")
        if f"{src}.o_proj.{kind}" in sd:
            sd[f"{dst}.out_proj.{kind}"] = sd.pop(f"{src}.o_proj.{kind}")


def fuse_swiglu(sd: dict, src: str, dst: str) -> None:
    """``down(act(gate(x)) * up(x))`` at ``src`` -> GatedMLP at ``dst`` (``fc1`` = [up; gate], ``fc2`` = down)."""
    for kind in ("weight", "bias"):
        fuse(sd, [f"{src}.up_proj.{kind}", f"{src}.gate_proj.{kind}"], f"{dst}.fc1.{kind}")
        if f"{src}.down_proj.{kind}" in sd:
            sd[f"{dst}.fc2.{kind}"] = sd.pop(f"{src}.down_proj.{kind}")


def swiglu_decoder_weights(sd: dict, final_norm: str, norm2: str, sublayers: dict[str, str],
                           attn: tuple[str, str], mlp: str) -> dict:
    """A transformers decoder with attention and a SwiGLU MLP in each layer (Bamba, Falcon-H1, MambaInLlama):
    ``decoder_rules`` renames, then per layer q/k/v at ``attn[0]`` fused into ``attn[1]``'s ``in_proj`` and
    the SwiGLU at ``mlp`` into ``mlp`` (GatedMLP); the renamed state dict."""
    sd = rename(sd, decoder_rules(final_norm, norm2, sublayers))
    for i in layer_indices(sd, "backbone.layers"):
        p = f"backbone.layers.{i}"
        fuse_attention(sd, f"{p}.{attn[0]}", f"{p}.{attn[1]}")
        fuse_swiglu(sd, f"{p}.{mlp}", f"{p}.mlp")
    return sd


def layer_indices(sd: dict, prefix: str) -> list[int]:
    """Sorted layer numbers that appear as ``{prefix}.{i}.`` in the weight names."""
    pat = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for k in sd if (m := pat.match(k))})


def stack_experts(sd: dict, src: str, projections: tuple[str, ...] = ("up_proj", "down_proj")) -> None:
    """Per-expert ``{src}.{e}.{proj}.weight`` tensors (as saved on disk) -> one ``[E, out, in]`` ``{src}.{proj}``."""
    for proj in projections:
        names = []
        while f"{src}.{len(names)}.{proj}.weight" in sd:
            names.append(f"{src}.{len(names)}.{proj}.weight")
        if names:
            sd[f"{src}.{proj}"] = torch.stack([sd.pop(n) for n in names])
