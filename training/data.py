"""Training batches from token-id arrays: random windows drawn by step, fixed validation windows, split over ranks.

Batches are drawn from the seed and the step alone, so every rank draws the same global batch (and keeps its rows
of it) and a resumed run sees what an uninterrupted one would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from stree.training.corpus import DEFAULT_PACKAGES, default_roots, list_files
from stree.training.distributed import DistEnv
from stree.training.token_cache import TokenSplits, bpe_for_corpus, tokenized_corpus


class WindowSampler:
    """Random training windows of ``seq_len + 1`` tokens, reproducible from the seed and step; ``rows`` picks this
    rank's rows of the global batch."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device, rows: slice = slice(None)):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed, self.device, self.rows = batch_size, seq_len, seed, device, rows

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)[self.rows]
        windows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        return torch.from_numpy(windows).to(self.device, non_blocking=True)


class RowSampler:
    """Random rows of a ``[N, seq_len + 1]`` array (sequences the target generated), drawn like ``WindowSampler``."""

    def __init__(self, rows: np.ndarray, batch_size: int, seed: int, device, rank_rows: slice = slice(None)):
        self.data, self.batch_size, self.seed, self.device, self.rank_rows = rows, batch_size, seed, device, rank_rows

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        pick = torch.randint(0, len(self.data), (self.batch_size,), generator=g)[self.rank_rows]
        return torch.from_numpy(self.data[pick.numpy()].astype(np.int64)).to(self.device, non_blocking=True)


def eval_windows(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int, device,
                 env: DistEnv | None = None, rows: int | None = None) -> list:
    """Fixed, evenly spaced validation windows (``n_batches * batch_size``, the same for every evaluation), in
    batches of ``rows`` (default ``batch_size``); with ``env``, this rank's share of the batches (ranks sum their
    results)."""
    count = n_batches * batch_size
    rows = rows or batch_size
    span = len(tokens) - seq_len - 1
    if span < 1:
        raise ValueError(f"validation split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    starts = np.linspace(0, span - 1, count).astype(np.int64)
    windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    batches = [torch.from_numpy(windows[i:i + rows]) for i in range(0, count, rows)]
    if env is not None:
        batches = batches[env.rank::env.world_size]
    return [b.to(device) for b in batches]


def default_cache_dir() -> str:
    """Where token ids and tokenizers are cached unless a command says otherwise: ``$XDG_CACHE_HOME/stree``
    (``~/.cache/stree``)."""
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stree")


def corpus_files(packages: Sequence[str] = DEFAULT_PACKAGES, roots=None, seed: int = 0, val_fraction: float = 0.02,
                 max_file_bytes: int | None = None):
    kw = {} if max_file_bytes is None else {"max_file_bytes": max_file_bytes}
    roots = [Path(r) for r in roots] if roots is not None else default_roots(packages)
    return list_files(packages, roots, seed, val_fraction, **kw), roots


def rank_zero_first(env: DistEnv, make):
    """``make()`` on rank 0, then on the other ranks (which then find its cached results)."""
    if env.is_main:
        out = make()
        env.barrier()
        return out
    env.barrier()
    return make()


def corpus_tokens(files, tokenizer, eos_id, max_bytes: int, cache_dir: str | os.PathLike, env: DistEnv,
                  workers: int | None = None) -> TokenSplits:
    """``tokenized_corpus`` made once by rank 0 and read by every rank."""
    return rank_zero_first(env, lambda: tokenized_corpus(files, tokenizer, eos_id, max_bytes, cache_dir, workers))


def corpus_bpe(files, vocab_size: int, text_bytes: int, cache_dir, env: DistEnv):
    """``bpe_for_corpus`` trained once by rank 0 and read by every rank."""
    return rank_zero_first(env, lambda: bpe_for_corpus(files, vocab_size, text_bytes, cache_dir))
