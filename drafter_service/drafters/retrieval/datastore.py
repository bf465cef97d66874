"""Retrieval datastore: a corpus of token sequences plus its suffix array, saved as a directory.

Layout of a saved datastore: ``header.json`` (format name and version, vocab size, counts),
``tokens.npy`` (all sequences concatenated, each followed by the separator -1) and
``suffix_array.npy`` (start positions of all suffixes in lexicographic order). Lookups find every
occurrence of a context suffix by binary search, as REST does, without a second index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

FORMAT_NAME = "stree-datastore"
FORMAT_VERSION = 1
HEADER_FILE = "header.json"
TOKENS_FILE = "tokens.npy"
SUFFIX_ARRAY_FILE = "suffix_array.npy"
SEPARATOR = -1


def build_suffix_array(text: np.ndarray) -> np.ndarray:
    """Suffix start positions of ``text`` in lexicographic order (prefix doubling, O(n log^2 n)).

    A suffix that is a prefix of another sorts first, as Python compares lists.
    """
    n = len(text)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(text, return_inverse=True)[1].astype(np.int64).reshape(-1)
    step = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        if step < n:
            second[: n - step] = rank[step:]
        order = np.lexsort((second, rank))
        first_sorted, second_sorted = rank[order], second[order]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (first_sorted[1:] != first_sorted[:-1]) | (second_sorted[1:] != second_sorted[:-1])
        sorted_rank = np.cumsum(new_group) - 1
        rank = np.empty(n, dtype=np.int64)
        rank[order] = sorted_rank
        if sorted_rank[-1] == n - 1 or step >= n:
            return order.astype(np.int64)
        step *= 2


class Datastore:
    """Token corpus with a suffix array; finds what followed a given context suffix in the corpus."""

    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray, vocab_size: int,
                 num_sequences: int, meta: Optional[dict] = None):
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.vocab_size = int(vocab_size)
        self.num_sequences = int(num_sequences)
        self.meta = dict(meta or {})

    # ----- building and storage -------------------------------------------------------------
    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, meta: Optional[dict] = None) -> "Datastore":
        """Concatenate ``sequences`` (token ids in ``[0, vocab_size)``) and sort their suffixes."""
        if int(vocab_size) < 1:
            raise ValueError(f"datastore: vocab_size must be >= 1, got {vocab_size}")
        parts, count = [], 0
        for k, seq in enumerate(sequences):
            arr = np.asarray(seq, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                continue
            if arr.min() < 0 or arr.max() >= vocab_size:
                bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                raise ValueError(f"datastore: sequence {k} has token {bad}, outside [0, {vocab_size})")
            parts.append(arr)
            parts.append(np.array([SEPARATOR], dtype=np.int64))
            count += 1
        if not parts:
            raise ValueError("datastore: the corpus has no tokens")
        text = np.concatenate(parts).astype(np.int32)
        sa = build_suffix_array(text)
        sa = sa.astype(np.int32) if len(text) < 2**31 else sa
        return cls(text, sa, vocab_size, count, meta)

    def header(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "num_tokens": int(len(self.tokens)),
            "num_sequences": self.num_sequences,
            "separator": SEPARATOR,
            "meta": self.meta,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the datastore directory (arrays first, header last, so a header means complete)."""
        out = Path(path)
        if out.exists() and not out.is_dir():
            raise ValueError(f"datastore: {out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / TOKENS_FILE, np.asarray(self.tokens))
        np.save(out / SUFFIX_ARRAY_FILE, np.asarray(self.suffix_array))
        (out / HEADER_FILE).write_text(json.dumps(self.header(), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: Optional[int] = None) -> "Datastore":
        """Open a saved datastore (arrays memory-mapped); ``vocab_size`` checks it fits a model's vocabulary."""
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"datastore {root} does not exist")
        if not root.is_dir():
            raise ValueError(f"datastore {root} is not a directory (expected {HEADER_FILE} + .npy files)")
        header = _read_header(root / HEADER_FILE)
        tokens = _read_array(root / TOKENS_FILE)
        sa = _read_array(root / SUFFIX_ARRAY_FILE)
        n = header["num_tokens"]
        if tokens.shape != (n,):
            raise ValueError(f"{root / TOKENS_FILE}: holds {tokens.shape} tokens but {HEADER_FILE} says {n}")
        if sa.shape != (n,):
            raise ValueError(
                f"{root / SUFFIX_ARRAY_FILE}: has shape {sa.shape}, does not match {n} tokens in {TOKENS_FILE}"
            )
        if n and (int(sa.min()) < 0 or int(sa.max()) >= n):
            raise ValueError(f"{root / SUFFIX_ARRAY_FILE}: positions outside [0, {n})")
        if n and (int(tokens.min()) < SEPARATOR or int(tokens.max()) >= header["vocab_size"]):
            raise ValueError(
                f"{root / TOKENS_FILE}: token ids outside [0, {header['vocab_size']}) (vocab_size in {HEADER_FILE})"
            )
        if vocab_size is not None and header["vocab_size"] > int(vocab_size):
            raise ValueError(
                f"datastore {root} was built for a vocabulary of {header['vocab_size']} tokens, larger than "
                f"the model's {vocab_size}: it was built with a different tokenizer"
            )
        return cls(tokens, sa, header["vocab_size"], header["num_sequences"], header.get("meta"))

    # ----- lookups --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    def _bound(self, query: list[int], past_equal: bool) -> int:
        """First suffix-array slot whose suffix (cut to len(query)) is >= query (> query if past_equal)."""
        lo, hi, m = 0, len(self.suffix_array), len(query)
        while lo < hi:
            mid = (lo + hi) // 2
            start = int(self.suffix_array[mid])
            head = self.tokens[start : start + m].tolist()
            if head < query or (past_equal and head == query):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def find(self, query: Sequence[int]) -> tuple[int, int]:
        """Suffix-array slots ``[lo, hi)`` of every occurrence of ``query`` in the corpus."""
        q = [int(t) for t in query]
        if not q:
            return 0, len(self.suffix_array)
        return self._bound(q, False), self._bound(q, True)

    def count(self, query: Sequence[int]) -> int:
        lo, hi = self.find(query)
        return hi - lo

    def longest_suffix_match(self, context: Sequence[int], max_len: int, min_len: int = 1) -> tuple[int, int, int]:
        """``(m, lo, hi)`` for the longest ``context[-m:]`` (min_len <= m <= max_len) in the corpus; m=0 if none.

        If a string occurs, so does each of its suffixes, so the longest length is found by bisection.
        """
        ctx = [int(t) for t in context[-max_len:]] if max_len > 0 else []
        best = (0, 0, 0)
        lo_len, hi_len = 0, len(ctx)  # context[-lo_len:] is known to occur (trivially for 0)
        while lo_len < hi_len:
            mid = (lo_len + hi_len + 1) // 2
            lo, hi = self.find(ctx[-mid:])
            if hi > lo:
                lo_len, best = mid, (mid, lo, hi)
            else:
                hi_len = mid - 1
        return best if best[0] >= max(min_len, 1) else (0, 0, 0)

    def info(self) -> dict:
        """Header fields plus a few corpus statistics."""
        out = self.header()
        toks = np.asarray(self.tokens)
        real = toks[toks != SEPARATOR]
        out["num_corpus_tokens"] = int(real.size)
        out["distinct_tokens"] = int(np.unique(real).size) if real.size else 0
        return out


def _read_header(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; not a datastore directory (build one with `stree datastore build`)")
    try:
        header = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: not a {FORMAT_NAME} header")
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format version {header.get('version')!r} is not supported (this stree reads {FORMAT_VERSION})"
        )
    for key in ("vocab_size", "num_tokens", "num_sequences"):
        if not isinstance(header.get(key), int) or header[key] < 0:
            raise ValueError(f"{path}: field {key!r} must be a non-negative integer, got {header.get(key)!r}")
    return header


def _read_array(path: Path) -> np.ndarray:
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing from the datastore")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # numpy raises several types for a damaged file
        raise ValueError(f"{path}: not a readable .npy array ({exc})") from exc
    if arr.ndim != 1 or arr.dtype.kind != "i":
        raise ValueError(f"{path}: expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr
