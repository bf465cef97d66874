"""Tokenizers written next to checkpoints: a byte-level BPE (``tokenizers``), or a character table for tiny vocabularies."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TOKENIZER_FILE = "tokenizer.json"
_MIN_BPE_VOCAB = 300  # 256 byte symbols + room for merges


def default_corpus() -> list[str]:
    """Offline text to train a small tokenizer on: the sources of a few standard-library modules."""
    import argparse, collections, json as _json, textwrap as _tw  # noqa: E401

    return [inspect.getsource(m) for m in (argparse, collections, _json, _tw)]


def char_tokenizer(vocab_size: int) -> Tokenizer:
    """One token per character (printable ASCII first), for toy models with tiny vocabularies."""
    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {"<unk>": 0}
    for ch in chars[: vocab_size - 1]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def bpe_tokenizer(vocab_size: int, texts: list[str] | None = None) -> Tokenizer:
    """Byte-level BPE of at most ``vocab_size`` tokens trained on ``texts`` (default corpus if None)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts or default_corpus(), trainer=trainer)
    return tok


def make_tokenizer(vocab_size: int, texts: list[str] | None = None) -> Tokenizer:
    return bpe_tokenizer(vocab_size, texts) if vocab_size >= _MIN_BPE_VOCAB else char_tokenizer(vocab_size)


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it has none."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: not a valid tokenizers file: {exc}") from exc


def eos_token_id(tok: Tokenizer | None) -> int | None:
    if tok is None:
        return None
    return tok.token_to_id("<|endoftext|>")
