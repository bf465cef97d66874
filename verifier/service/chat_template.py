"""Chat templates from a model folder's ``tokenizer_config.json``, rendered the way transformers does.

Jinja2 in a sandbox, ``trim_blocks``/``lstrip_blocks``, with ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and ``raise_exception``. A folder without a template gets a plain
``role: content`` layout ending in ``assistant:``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG_FILE = "tokenizer_config.json"
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the messages, or could not be rendered."""


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} as transformers writes added tokens
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """One compiled template plus the special tokens it may use."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        def raise_exception(message):
            raise ChatTemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, model_dir: Optional[str]) -> "ChatTemplate":
        path = Path(model_dir) / CONFIG_FILE if model_dir else None
        if path is None or not path.exists():
            return cls(PLAIN_TEMPLATE)
        try:
            config = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        source = config.get("chat_template") or PLAIN_TEMPLATE
        if isinstance(source, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), PLAIN_TEMPLATE)
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
