"""The one schema of bounds a generation request is checked against, by every front end (gRPC and HTTP).

Each check takes the value as the client sent it and the field's name as that client spells it
(``sampling.temperature`` over gRPC, ``temperature`` over HTTP) and returns the checked value, or raises
``FieldError`` naming the field and its bound. A value no check lets through can't fail an engine step
that other clients' sequences share: temperature stays within what the warp computes in float32, stop
strings are few and short (the stop scan runs every step), ids stay within the vocabulary and text is
valid Unicode. Error messages echo at most ``MAX_ECHO_CHARS`` characters of what the client sent;
``log_field`` is what a log line may carry of a client's string.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from .sampling import MAX_TOP_K, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams

MAX_TEMPERATURE = 2.0
"""Highest temperature (OpenAI's bound): past it sampling is all but uniform, and float32 logits / T underflow."""
MAX_STOPS = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 128
MAX_DRAFTER_NAME_CHARS = 128
MAX_ECHO_CHARS = 64
"""Characters of a client's value an error message repeats (gRPC carries the message in its trailers)."""
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_BYTES_PER_TOKEN = 8
"""Average prompt bytes per token the default prompt cap allows (byte-level BPE on code or prose: about 3-5)."""

__all__ = [
    "FieldError", "MAX_DRAFTER_NAME_CHARS", "MAX_ECHO_CHARS", "MAX_REQUEST_ID_CHARS", "MAX_STOPS",
    "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_TEMPERATURE", "check_drafter_name", "check_max_new_tokens",
    "check_prompt_ids", "check_prompt_size", "check_request_id", "check_sampling", "check_stop_ids",
    "check_stops", "check_text", "log_field", "prompt_byte_limit", "shorten",
]


class FieldError(ValueError):
    """A request value outside its bound: ``field`` is the offending field as the client names it."""

    def __init__(self, field: Optional[str], message: str):
        super().__init__(message)
        self.field = field


def shorten(value, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr`` of a client's value cut to about ``limit`` characters (control characters escaped)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more characters)"


def log_field(value, limit: int = 128) -> str:
    """A client's string as a log line may carry it: non-printable characters escaped, cut to ``limit``."""
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _number(value, field: str, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(field, f"{field} must be a number, got {shorten(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(field, f"{field} must be finite, got {value}")
    if integer and int(value) != value:
        raise FieldError(field, f"{field} must be an integer, got {value}")
    return int(value) if integer else value


def check_sampling(temperature=0.0, top_k=0, top_p=1.0, seed=None, prefix: str = "") -> SamplingParams:
    """``SamplingParams`` from client values: temperature 0 (greedy) or in [1e-3, 2], top_k an integer in
    0..2^32-1 (0: off), top_p in [1e-6, 1], seed an integer in -2^63..2^64-1 or None."""
    t_name, k_name, p_name, s_name = (prefix + n for n in ("temperature", "top_k", "top_p", "seed"))
    temperature = _number(temperature, t_name)
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise FieldError(t_name, f"{t_name} must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                 f"got {temperature:g}")
    top_k = _number(top_k, k_name, integer=True)
    if not 0 <= top_k <= MAX_TOP_K:
        raise FieldError(k_name, f"{k_name} must be in 0..{MAX_TOP_K} (0 disables it), got {top_k}")
    top_p = _number(top_p, p_name)
    if not MIN_TOP_P <= top_p <= 1.0:
        raise FieldError(p_name, f"{p_name} must be in [{MIN_TOP_P}, 1], got {top_p:g}")
    if seed is not None:
        seed = _number(seed, s_name, integer=True)
        if not MIN_SEED <= seed <= MAX_SEED:
            raise FieldError(s_name, f"{s_name} must be in {MIN_SEED}..{MAX_SEED}, got {seed}")
    return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed)


def check_text(value: str, field: str) -> str:
    """``value`` when it is valid Unicode (a lone UTF-16 surrogate, which JSON can carry, is not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(field, f"{field} holds a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X}) at "
                                f"character {exc.start}: send valid Unicode") from None
    return value


def check_stops(stops: Sequence[str], field: str = "stop") -> list[str]:
    """At most ``MAX_STOPS`` stop strings of 1 to ``MAX_STOP_CHARS`` characters each."""
    stops = list(stops)
    if len(stops) > MAX_STOPS:
        raise FieldError(field, f"{field} has {len(stops)} strings, over the limit of {MAX_STOPS}")
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise FieldError(field, f"{field} must hold strings, got {shorten(s)} at index {i}")
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            raise FieldError(field, f"each {field} string must have 1 to {MAX_STOP_CHARS} characters; "
                                    f"index {i} has {len(s)}")
        check_text(s, f"{field}[{i}]")
    return stops


def _ids_in_vocab(ids: Iterable, vocab_size: int, field: str) -> list[int]:
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise FieldError(field, f"{field} must hold token ids (integers), got {shorten(t)} at index {i}")
        if not 0 <= t < vocab_size:
            raise FieldError(field, f"{field}[{i}] = {t} is outside the vocabulary (token ids are 0..{vocab_size - 1})")
        out.append(t)
    return out


def check_stop_ids(ids: Sequence[int], vocab_size: int, field: str = "stop_token_ids") -> list[int]:
    """At most ``MAX_STOP_TOKEN_IDS`` stop token ids, each in the vocabulary."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise FieldError(field, f"{field} has {len(ids)} ids, over the limit of {MAX_STOP_TOKEN_IDS}")
    return _ids_in_vocab(ids, vocab_size, field)


def check_prompt_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt") -> list[int]:
    """A non-empty prompt of token ids, each in the vocabulary (the message names the first one outside it)."""
    if len(ids) == 0:
        raise FieldError(field, "the prompt is empty (it must have at least one token)")
    return _ids_in_vocab(ids, vocab_size, field)


def check_prompt_size(text: str, max_bytes: int, field: str = "prompt") -> str:
    """Prompt text of at most ``max_bytes`` UTF-8 bytes (checked before tokenizing), and valid Unicode."""
    if len(text) > max_bytes:  # a character is at least one byte: no need to encode a huge prompt
        raise FieldError(field, f"{field} has {len(text)} characters, over the server's limit of {max_bytes} "
                                f"bytes")
    check_text(text, field)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise FieldError(field, f"{field} has {size} bytes, over the server's limit of {max_bytes}")
    return text


def check_max_new_tokens(value: int, limit: int, field: str = "max_new_tokens") -> int:
    value = _number(value, field, integer=True)
    if not 1 <= value <= limit:
        raise FieldError(field, f"{field} must be in 1..{limit} (the server's limit), got {value}")
    return value


def _check_name(value: str, field: str, limit: int) -> str:
    if not isinstance(value, str):
        raise FieldError(field, f"{field} must be a string")
    if len(value) > limit:
        raise FieldError(field, f"{field} has {len(value)} characters, over the limit of {limit}")
    if not value.isprintable():
        raise FieldError(field, f"{field} must be printable text (no newlines or control characters), got "
                                f"{shorten(value)}")
    return value


def check_request_id(value: str, field: str = "request_id") -> str:
    """A client's request id: at most ``MAX_REQUEST_ID_CHARS`` printable characters (it goes into log lines)."""
    return _check_name(value, field, MAX_REQUEST_ID_CHARS)


def check_drafter_name(value: str, field: str = "drafter") -> str:
    """A drafter name as a client asks for it: at most ``MAX_DRAFTER_NAME_CHARS`` printable characters."""
    return _check_name(value, field, MAX_DRAFTER_NAME_CHARS)


def prompt_byte_limit(max_tokens: int, longest_token_bytes: int) -> int:
    """Default cap on prompt bytes for prompts of at most ``max_tokens`` tokens: ``longest_token_bytes`` per token
    (no token covers more, so no longer prompt fits), but at most ``MAX_BYTES_PER_TOKEN`` per token on average
    (vocabularies with long whitespace runs would otherwise admit bodies megabytes long)."""
    return max(1, int(max_tokens)) * max(1, min(int(longest_token_bytes), MAX_BYTES_PER_TOKEN))
