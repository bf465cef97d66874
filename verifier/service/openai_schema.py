"""OpenAI request bodies -> checked generation parameters; every refusal names its field.

JSON types are checked here; the bounds are ``protocols.request_limits`` (the ones the gRPC API checks too).
Unknown fields are refused (a silently ignored option would change what the client gets), and so
are options this server does not implement (logprobs, penalties, echo, best_of, tools). A refusal
repeats at most ``MAX_ECHO_CHARS`` characters of what the client sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from stree.protocols.request_limits import (
    FieldError,
    check_drafter_name,
    check_sampling,
    check_stops,
    check_text,
    shorten,
)
from stree.protocols.sampling import SamplingParams
from stree.verifier.service.core import ServerLimits

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
          "seed", "user", "logprobs", "presence_penalty", "frequency_penalty", "ignore_eos", "drafter",
          "stop_token_ids", "logit_bias"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "response_format", "add_generation_prompt", "parallel_tool_calls"}


class BadField(FieldError):
    """A 400: ``param`` is the offending field."""

    @property
    def param(self) -> Optional[str]:
        return self.field


@dataclass
class ApiRequest:
    model: str
    prompt_text: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    messages: Optional[list[dict]] = None
    add_generation_prompt: bool = True
    max_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    drafter: str = ""
    user: str = ""


def _number(body: dict, key: str, default, kind=float, low=None, high=None):
    value = body.get(key)
    if value is None:
        return default
    finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))  # JSON allows NaN, inf
    if isinstance(value, bool) or not finite or (kind is int and int(value) != value):
        raise BadField(key, f"'{key}' must be {'an integer' if kind is int else 'a finite number'}, "
                            f"got {shorten(value)}")
    if low is not None and value < low:
        raise BadField(key, f"'{key}' must be >= {low}, got {value}")
    if high is not None and value > high:
        raise BadField(key, f"'{key}' must be <= {high}, got {value}")
    try:
        return kind(value)
    except OverflowError:  # an integer past float range
        raise BadField(key, f"'{key}' is out of range, got {value}") from None


def _flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadField(key, f"'{key}' must be true or false, got {shorten(value)}")
    return value


def _refuse_unsupported(body: dict) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadField(key, f"'{key}' is not supported by this server (only 0)")
    if body.get("logprobs") not in (None, False, 0):
        raise BadField("logprobs", "'logprobs' is not supported by this server")
    if body.get("top_logprobs") not in (None, 0):
        raise BadField("top_logprobs", "'top_logprobs' is not supported by this server")
    if body.get("echo") not in (None, False):
        raise BadField("echo", "'echo' is not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise BadField("best_of", "'best_of' is not supported by this server (only 1)")
    if body.get("suffix") not in (None, ""):
        raise BadField("suffix", "'suffix' is not supported by this server")
    if body.get("logit_bias"):
        raise BadField("logit_bias", "'logit_bias' is not supported by this server")
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise BadField("tools", "tool calls are not supported by this server")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise BadField("response_format", "only response_format {'type': 'text'} is supported")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadField("stop", "'stop' must be a string or a list of strings")
    try:
        return check_stops(stops, "stop")
    except FieldError as exc:
        raise BadField("stop", str(exc)) from None


def _text(value: str, param: str) -> str:
    try:
        return check_text(value, param)
    except FieldError as exc:
        raise BadField(param, str(exc)) from None


def _prompt(body: dict, req: ApiRequest) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
        req.prompt_text = _text(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        req.prompt_ids = list(prompt)
    elif prompt is None:
        raise BadField("prompt", "'prompt' is required")
    else:
        raise BadField("prompt", "'prompt' must be a string, a list of token ids, or a list of one of those")


def _messages(body: dict, req: ApiRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField(f"messages[{i}]", f"messages[{i}] must be an object with a 'role'")
        _text(m["role"], f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise BadField(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise BadField(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append({**m, "content": _text(content or "", f"messages[{i}].content")})
    req.messages = out
    req.add_generation_prompt = _flag(body, "add_generation_prompt", True)


def parse(body, chat: bool, models: set[str], limits: ServerLimits) -> ApiRequest:
    """Check an OpenAI completions / chat completions body against this server's limits."""
    if not isinstance(body, dict):
        raise BadField(None, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = shorten(unknown[0])[1:-1]
        raise BadField(name, f"unknown field '{name}'")
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        raise BadField("model", f"the model {shorten(model)} does not exist; this server serves {sorted(models)}")
    _refuse_unsupported(body)
    req = ApiRequest(model=model)
    (_messages if chat else _prompt)(body, req)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _number(body, key, 0, int, 1, limits.max_new_tokens)
    temperature = _number(body, "temperature", 1.0, float)
    top_p = _number(body, "top_p", 1.0, float)
    top_k = _number(body, "top_k", 0, int) if body.get("top_k") != -1 else 0  # vLLM's -1: off
    seed = _number(body, "seed", None, int)
    try:
        req.params = check_sampling(temperature, top_k, top_p, seed)
    except FieldError as exc:
        raise BadField(exc.field, str(exc)) from None
    req.n = _number(body, "n", 1, int, 1, limits.max_num_samples)
    req.stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise BadField("stream_options", "'stream_options' may only hold 'include_usage'")
        if not req.stream:
            raise BadField("stream_options", "'stream_options' needs 'stream': true")
        req.include_usage = _flag(opts, "include_usage")
    req.stops = _stops(body)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadField("stop_token_ids", "'stop_token_ids' must be a list of token ids")
    req.stop_ids = ids
    req.ignore_eos = _flag(body, "ignore_eos")
    drafter = body.get("drafter", "")
    if not isinstance(drafter, str):
        raise BadField("drafter", "'drafter' must be a drafter name")
    try:
        req.drafter = check_drafter_name(drafter)
    except FieldError as exc:
        raise BadField("drafter", str(exc)) from None
    user = body.get("user", "")
    req.user = user if isinstance(user, str) else ""
    return req
