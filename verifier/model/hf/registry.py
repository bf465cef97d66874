"""Which checkpoint formats load: mamba_ssm's own, HF Mamba2 and the HF hybrids in FAMILIES; other classes are refused by name."""

from __future__ import annotations

from typing import Callable

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf import bamba, falcon_h1, granitemoehybrid, mambainllama, nemotron_h, zamba2

# each family: MODEL_TYPE, CLASS_NAME, config(config.json dict) and weights(state dict, config.json dict)
FAMILIES = {f.MODEL_TYPE: f for f in (bamba, nemotron_h, granitemoehybrid, falcon_h1, zamba2, mambainllama)}
SUPPORTED_CLASSES = {"mamba2": "Mamba2ForCausalLM", **{t: f.CLASS_NAME for t, f in FAMILIES.items()}}


def _mamba2_weights(sd: dict) -> dict:
    return {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in sd.items()}


def _unchanged(sd: dict) -> dict:
    return sd


def is_hf(data: dict) -> bool:
    return "d_model" not in data and ("hidden_size" in data or "model_type" in data)


def resolve(data: dict) -> tuple[ModelConfig, Callable[[dict], dict]]:
    """``(config, weight renamer)`` for a parsed ``config.json``; a ValueError names an unsupported class."""
    if not isinstance(data, dict):
        raise ValueError("config: expected a JSON object")
    if not is_hf(data):
        return ModelConfig.from_dict(data), _unchanged
    model_type = data.get("model_type", "mamba2")
    if model_type not in SUPPORTED_CLASSES:
        cls = ", ".join(data.get("architectures") or []) or f"model_type {model_type!r}"
        raise ValueError(
            f"config: {cls} is not supported; supported classes: {', '.join(SUPPORTED_CLASSES.values())}"
        )
    try:
        if model_type in FAMILIES:
            family = FAMILIES[model_type]
            return family.config(data), lambda sd: family.weights(sd, data)
        return ModelConfig.from_hf_dict(data), _mamba2_weights
    except KeyError as exc:
        raise ValueError(f"config: {SUPPORTED_CLASSES[model_type]} config is missing {exc}") from exc
