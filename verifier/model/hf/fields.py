"""A Hugging Face ``config.json`` read as the transformers config class of the checked version reads it.

Each family module declares a ``ConfigSpec``: every field of its transformers config class with that class's
default, which of them do not change the forward pass (and why), the legacy names the class still accepts, and
the keys that are not fields but that transformers reads (``getattr(config, "head_dim", ...)``) or writes and
ignores. ``ConfigSpec.read`` fills the defaults, applies the legacy names, refuses what no family can run and
warns about keys it does not know (a field of a transformers release the loaders were not checked against).
``tests/verifier/test_hf_config_fields.py`` walks the transformers classes and holds these specs to them.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

TRANSFORMERS_CHECKED = "5.24"  # the transformers release whose config classes and forward passes these follow

# Fields every transformers config has (PreTrainedConfig's own), none of which changes a causal LM's logits.
BASE_FIELDS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
})
# Other keys config.json files carry that no family reads for the forward pass: bookkeeping, the dtype's old
# name (read by ``checkpoint.config_dtype``), remote-code maps, and transformers 4.x's saved generation defaults.
_COMMON_KEYS = frozenset({
    "model_type", "_name_or_path", "name_or_path", "output_attentions", "torch_dtype", "_commit_hash",
    "attn_implementation", "experts_implementation", "_attn_implementation_autoset", "auto_map", "use_return_dict", "torchscript",
    "use_bfloat16", "pruned_heads", "tie_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "tf_legacy_loss", "sep_token_id", "decoder_start_token_id", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})
# Keys that change the weights' meaning in a way no family here runs.
_REFUSED_KEYS = {"quantization_config": "quantized weights are not supported (stree loads float weights)"}

# Why an ignored field does not change the logits (the reasons the specs give).
INIT = "initialisation only"
TRAINING = "training only (dropout, auxiliary losses, kernel choice)"
GENERATION = "generation and cache settings, not the forward pass"
NUMERICS = "how the same scan is computed (chunking), not what"
# fields most classes share that no forward pass reads
GENERATION_FIELDS = {"use_cache": GENERATION, "pad_token_id": GENERATION, "bos_token_id": GENERATION,
                     "eos_token_id": GENERATION}
DECODER_IGNORED = {**GENERATION_FIELDS, "initializer_range": INIT, "attention_dropout": TRAINING,
                   "max_position_embeddings": "plain RoPE does not read it"}


@dataclass(frozen=True)
class ConfigSpec:
    """How one family reads ``config.json``, checked field by field against ``class_name`` in transformers."""

    class_name: str
    defaults: dict[str, Any]  # every field of the class -> its default there
    ignored: dict[str, str]  # fields that do not change the forward pass -> why
    aliases: dict[str, str] = field(default_factory=dict)  # legacy key -> the field it sets (it wins)
    optional: dict[str, Any] = field(default_factory=dict)  # non-field keys the forward reads when present
    extra_ignored: frozenset = frozenset()  # non-field keys written by transformers or old releases, not read

    def read(self, data: dict) -> "Fields":
        """The config as the transformers class sees it: every field (defaulted), optional keys when present."""
        for key, why in _REFUSED_KEYS.items():
            if data.get(key):
                raise ValueError(f"config: {key} is not supported: {why}")
        known = (set(self.defaults) | set(self.optional) | set(self.aliases) | self.extra_ignored | BASE_FIELDS
                 | _COMMON_KEYS)
        unknown = sorted(set(data) - known)
        if unknown:
            warnings.warn(
                f"config.json: {unknown} {'is not a field' if len(unknown) == 1 else 'are not fields'} of "
                f"transformers {TRANSFORMERS_CHECKED}'s {self.class_name}, the version this loader follows; "
                "ignored, as that version ignores them", CheckpointWarning, stacklevel=4)
        values = {**self.defaults, **{k: v for k, v in data.items() if k in self.defaults}}
        values.update({k: data[k] for k in self.optional if k in data})
        values.update({new: data[old] for old, new in self.aliases.items() if old in data})
        return Fields(values, self.class_name)


class CheckpointWarning(UserWarning):
    """A checkpoint's config key or tensor that loading ignores, as the transformers version it follows does."""


class Fields(dict):
    """Config values by field name, with typed accessors whose errors name the field."""

    def __init__(self, values: dict, class_name: str):
        super().__init__(values)
        self.class_name = class_name

    def _typed(self, key: str, kind, allow_none: bool = False):
        value = self[key] if key in self else None
        if value is None and allow_none:
            return None
        if kind is bool:
            if isinstance(value, bool):
                return value
        elif kind is float:
            if isinstance(value, dict) and "__float__" in value:  # transformers' JSON encoding of inf / nan
                return float(value["__float__"])
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"config: {key}={value!r} is not a{'n' if kind is int else ''} {kind.__name__}")

    def int(self, key: str, allow_none: bool = False):
        return self._typed(key, int, allow_none)

    def float(self, key: str, allow_none: bool = False):
        return self._typed(key, float, allow_none)

    def bool(self, key: str):
        return self._typed(key, bool)

    def refuse_unless(self, key: str, *allowed) -> None:
        """A ValueError naming ``key`` when its value is none of ``allowed``."""
        if self.get(key) not in allowed:
            only = " or ".join(repr(a) for a in allowed)
            raise ValueError(f"config: {key}={self.get(key)!r} is not supported (only {only})")

    def float_pair(self, key: str) -> list[float]:
        value = self.get(key)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"config: {key}={value!r} must be two numbers")
        return [Fields({"v": v}, self.class_name).float("v") for v in value]


def dt_limit(fields: Fields, key: str = "time_step_limit") -> list[float]:
    """The dt clamp ``(lo, hi)`` from a ``time_step_limit`` field (None: no clamp)."""
    return [0.0, math.inf] if fields.get(key) is None else fields.float_pair(key)


def warn_unread(names: list[str], why: str) -> None:
    """Warn that checkpoint tensors ``names`` are not loaded (``why``: transformers does not use them either)."""
    if names:
        shown = ", ".join(sorted(names)[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        warnings.warn(f"checkpoint tensors not loaded: {shown} ({why})", CheckpointWarning, stacklevel=4)
