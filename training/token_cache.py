"""The corpus tokenized once, in parallel, and kept on disk as token-id memmaps that later phases reuse.

``tokenized_corpus`` reads and tokenizes the corpus's files in worker processes (each with its own copy of the
tokenizer), keeps them in corpus order, drops duplicates and stops at the byte cap exactly as ``iter_documents``
does, and writes ``train.bin`` / ``val.bin`` (uint16 ids where the vocabulary fits, else uint32; the EOS id after
each document) with a ``meta.json``, under a folder named by a hash of everything that decides the result (the
tokenizer, the files' relative paths and sizes, the cap). A second call with the same inputs only maps the files.
``bpe_for_corpus`` trains (and caches) the byte-level BPE the demo and scale pairs use, on the corpus's first
training files.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from stree.training.corpus import DocumentFilter, SourceFile, content_key, iter_documents, read_text, split_check

CACHE_VERSION = 1
_WORKER_TOKENIZER: Tokenizer | None = None


@dataclass
class TokenSplits:
    """Token ids of the train and validation splits (memmaps), and how they were made."""

    train: np.ndarray
    val: np.ndarray
    meta: dict


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def files_digest(files: Sequence[SourceFile]) -> str:
    return _digest(*(f"{f.rel}:{f.size}:{int(f.val)}" for f in files))


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode_file(path: str):
    """``(content key, text bytes, ids)`` of one file, or None (unreadable or binary)."""
    text = read_text(path)
    if text is None:
        return None
    ids = _WORKER_TOKENIZER.encode(text, add_special_tokens=False).ids
    return content_key(text), len(text.encode("utf-8")), np.asarray(ids, dtype=np.uint32)


def _encoded(files: Sequence[SourceFile], tokenizer_json: str, workers: int):
    """``_encode_file`` of each file, in order; ``workers`` > 1 spreads them over processes."""
    if workers <= 1:
        _init_worker(tokenizer_json)
        for f in files:
            yield _encode_file(f.path)
        return
    ctx = multiprocessing.get_context("fork")  # as DataLoader workers: no re-import of the main module
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_json,)) as pool:
        yield from pool.imap(_encode_file, [f.path for f in files], chunksize=8)


def tokenized_corpus(files: Sequence[SourceFile], tokenizer: Tokenizer, eos_id: int | None, max_bytes: int,
                     cache_dir: str | os.PathLike, workers: int | None = None, desc: str = "tokenize") -> TokenSplits:
    """The corpus's token ids (cached under ``cache_dir``); ``workers`` defaults to the CPU count."""
    tokenizer_json = tokenizer.to_str()
    key = _digest(CACHE_VERSION, tokenizer_json, eos_id, max_bytes, files_digest(files))
    folder = Path(cache_dir) / f"tokens-{key}"
    if (folder / "meta.json").exists():
        return _open(folder)
    workers = workers or os.cpu_count() or 1
    keep = DocumentFilter(max_bytes)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    eos = None if eos_id is None else np.asarray([eos_id], dtype=np.uint32)
    total = min(max_bytes, sum(f.size for f in files))
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, mininterval=2.0) as bar:
        for f, enc in zip(files, _encoded(files, tokenizer_json, workers)):
            if keep.full:
                break
            if enc is None or not keep.keep(enc[0], enc[1]):
                continue
            parts[f.val].append(enc[2])
            if eos is not None:
                parts[f.val].append(eos)
            counts[f.val] += 1
            bar.update(min(enc[1], bar.total - bar.n))
    if not counts[True] and counts[False] > 1:  # no file drew validation: hold out the last one (as build_corpus)
        step = 2 if eos is not None else 1
        parts[True], parts[False] = parts[False][-step:], parts[False][:-step]
        counts[True], counts[False] = 1, counts[False] - 1
    split_check(counts[False], counts[True], len(files))
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for split, val in (("train", False), ("val", True)):
        ids = np.concatenate(parts[val]).astype(dtype)
        ids.tofile(tmp / f"{split}.bin")
        sizes[split] = int(len(ids))
    meta = {"version": CACHE_VERSION, "dtype": np.dtype(dtype).name, "vocab_size": vocab, "eos_id": eos_id,
            "train_tokens": sizes["train"], "val_tokens": sizes["val"], "train_files": counts[False],
            "val_files": counts[True], "bytes": keep.total, "duplicates": keep.duplicates, "max_bytes": max_bytes,
            "candidates": len(files), "workers": workers}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the same cache first
        pass
    return _open(folder)


def _open(folder: Path) -> TokenSplits:
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    maps = {s: np.memmap(folder / f"{s}.bin", dtype=dtype, mode="r", shape=(meta[f"{s}_tokens"],))
            for s in ("train", "val")}
    return TokenSplits(maps["train"], maps["val"], {**meta, "cache": str(folder)})


def bpe_for_corpus(files: Sequence[SourceFile], vocab_size: int, text_bytes: int, cache_dir: str | os.PathLike):
    """A byte-level BPE of ``vocab_size`` trained on the first ``text_bytes`` of the corpus's training files
    (cached under ``cache_dir``)."""
    from stree.verifier.model.tokenizer import bpe_tokenizer

    path = Path(cache_dir) / f"bpe-{_digest(CACHE_VERSION, vocab_size, text_bytes, files_digest(files))}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    texts = [text for f, text in iter_documents([f for f in files if not f.val], text_bytes)]
    tokenizer = bpe_tokenizer(vocab_size, texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    tmp.replace(path)
    return tokenizer
