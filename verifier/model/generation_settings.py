"""Tokenizer and generation settings read from a model folder: end/pad ids, special tokens, the chat template.

``generation_config.json`` decides the EOS ids (one or several) when it names them; otherwise
``config.json``, then ``tokenizer_config.json``'s ``eos_token``, then the ``<|endoftext|>`` token.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from stree.verifier.model.tokenizer import load_tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _ids(value, where: str) -> list[int]:
    """An id or a list of ids from JSON (None -> [])."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: expected a token id or a list of ids >= 0, got {value!r}")
    return list(values)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class GenerationSettings:
    """What a model folder says about tokenizing and stopping."""

    tokenizer: Tokenizer | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    special_tokens: dict = field(default_factory=dict)
    chat_template: str | None = None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text the folder's chat template makes of ``messages`` (role/content dicts)."""
        if not self.chat_template:
            raise ValueError(f"{TOKENIZER_CONFIG_FILE} has no chat_template")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise ValueError("rendering a chat template needs jinja2 (the 'chat' extra)") from exc

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


def load_generation_settings(model_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None):
    """Settings of ``model_dir``; the tokenizer files come from ``tokenizer_dir`` when given (``--tokenizer``)."""
    model_dir = Path(model_dir)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"{tok_dir}: tokenizer directory does not exist")
    tokenizer = load_tokenizer(tok_dir)
    tok_cfg = _read_json(tok_dir / TOKENIZER_CONFIG_FILE)
    gen = _read_json(model_dir / GENERATION_CONFIG_FILE)
    cfg = _read_json(model_dir / "config.json")
    special = {k: t for k in SPECIAL_KEYS if (t := _token_text(tok_cfg.get(k))) is not None}

    def token_id(text: str | None) -> int | None:
        return tokenizer.token_to_id(text) if (tokenizer is not None and text) else None

    eos = _ids(gen.get("eos_token_id"), f"{model_dir / GENERATION_CONFIG_FILE}: eos_token_id")
    if not eos:
        eos = _ids(cfg.get("eos_token_id"), f"{model_dir / 'config.json'}: eos_token_id")
    if not eos:
        found = token_id(special.get("eos_token")) if "eos_token" in special else token_id("<|endoftext|>")
        eos = [] if found is None else [found]
    pad = _ids(gen.get("pad_token_id", cfg.get("pad_token_id")), "pad_token_id") or [token_id(special.get("pad_token"))]
    bos = _ids(gen.get("bos_token_id", cfg.get("bos_token_id")), "bos_token_id") or [token_id(special.get("bos_token"))]
    template = tok_cfg.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{tok_dir / TOKENIZER_CONFIG_FILE}: chat_template must be a string")
    return GenerationSettings(tokenizer, eos, pad[0], bos[0], special, template)
