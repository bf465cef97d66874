"""Which checkpoint formats load: mamba_ssm's own and the Hugging Face classes in FAMILIES; other classes are
refused by name."""

from __future__ import annotations

from typing import Callable

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hf import bamba, falcon_h1, granitemoehybrid, mamba2, mambainllama, nemotron_h, zamba2

# each family: MODEL_TYPE, CLASS_NAME, SPEC (how config.json is read), config(fields) and weights(state dict, fields)
FAMILIES = {f.MODEL_TYPE: f for f in (mamba2, bamba, nemotron_h, granitemoehybrid, falcon_h1, zamba2, mambainllama)}
SUPPORTED_CLASSES = {t: f.CLASS_NAME for t, f in FAMILIES.items()}


def _unchanged(sd: dict) -> dict:
    return sd


def is_hf(data: dict) -> bool:
    return "d_model" not in data and ("hidden_size" in data or "model_type" in data)


def resolve(data: dict) -> tuple[ModelConfig, Callable[[dict], dict]]:
    """``(config, weight renamer)`` for a parsed ``config.json``; a ValueError names an unsupported class or
    field."""
    if not isinstance(data, dict):
        raise ValueError("config: expected a JSON object")
    if not is_hf(data):
        return ModelConfig.from_dict(data), _unchanged
    model_type = data.get("model_type", "mamba2")
    if model_type not in FAMILIES:
        cls = ", ".join(data.get("architectures") or []) or f"model_type {model_type!r}"
        raise ValueError(
            f"config: {cls} is not supported; supported classes: {', '.join(SUPPORTED_CLASSES.values())}"
        )
    family = FAMILIES[model_type]
    fields = family.SPEC.read(data)
    return family.config(fields), lambda sd: family.weights(sd, fields)
