"""``stree.generate``: the engine's ``generate`` that also takes text when the model has a tokenizer.

A model loaded with ``stree.load_model`` keeps its folder's ``tokenizer.json`` as ``model.tokenizer`` (None when
the folder has none). With one, a prompt may be a string or a list of strings, and every result carries ``.text``.
"""

from __future__ import annotations

from stree.verifier.decode.loop import generate as generate_ids


def generate(model, prompt, *args, tokenizer=None, **kwargs):
    """Generate after ``prompt``: token ids (a list or 1-D tensor), a string, or a list of either (one result each).

    ``tokenizer`` (a ``tokenizers.Tokenizer``) defaults to ``model.tokenizer``; it encodes text prompts and decodes
    every result's ``.text``. Every other argument is ``stree.verifier.decode.loop.generate``'s (``drafter``,
    ``draft_model``, ``max_new_tokens``, ``temperature``, ``tree``, ...).
    """
    tokenizer = model.tokenizer if tokenizer is None else tokenizer
    if isinstance(prompt, str):
        return generate_ids(model, _encode(tokenizer, prompt, "prompt"), *args, tokenizer=tokenizer, **kwargs)
    if isinstance(prompt, (list, tuple)) and prompt and any(isinstance(p, str) for p in prompt):
        if not all(isinstance(p, str) for p in prompt):
            raise ValueError("prompt: a list of prompts must be all strings or all token-id lists, not a mix")
        ids = [_encode(tokenizer, p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return generate_ids(model, ids, *args, tokenizer=tokenizer, **kwargs)
    return generate_ids(model, prompt, *args, tokenizer=tokenizer, **kwargs)


def _encode(tokenizer, text: str, field: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"{field} is text, but the model has no tokenizer (its folder has no tokenizer.json): pass "
                         "token ids, or tokenizer=tokenizers.Tokenizer.from_file(PATH)")
    ids = tokenizer.encode(text).ids
    if not ids:
        raise ValueError(f"{field} encodes to no tokens")
    return ids
