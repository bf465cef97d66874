"""Sampling parameters and the one logits-to-probabilities warp that target and drafts share.

Lossless speculative sampling needs the draft and the target warped identically
(temperature, then top-k, then top-p), so this module is the only place that does it.
"""

from __future__ import annotations

import math
import numbers

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch


# Smallest temperature and top_p that stay meaningful in float32 (1e-300 passed and underflowed later).
MIN_TEMPERATURE = 1e-3
MIN_TOP_P = 1e-6


MAX_TOP_K = 2**32 - 1
"""Largest top_k accepted (the gRPC field's range); any value at or past the vocabulary size is no filter."""


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == float("inf"):
            raise ValueError("temperature must be finite")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # logits / t would overflow float32
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}")
        if isinstance(self.top_k, float) and not math.isfinite(self.top_k):  # int() of these raises others
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if self.top_k > MAX_TOP_K:  # the engine keeps top_k in int64 device tensors
            raise ValueError(f"top_k must be <= {MAX_TOP_K} (any value past the vocabulary disables it), "
                             f"got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:  # below float32 resolution of a probability sum
            raise ValueError(f"top_p must be >= {MIN_TOP_P}, got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, along the last dim (float32).

    Greedy params give a one-hot at the argmax (ties broken toward the lower token id, as
    ``torch.argmax`` does), so greedy is the zero-temperature limit of the same rule.
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def warp_logits_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """``warp_logits`` with per-row parameters, as fixed-shape tensor ops (no host sync; float32).

    ``logits`` is ``[B, ..., V]``; ``temperature``, ``top_k``, ``top_p`` are ``[B]`` tensors applying
    to every row under batch entry b. Row by row the result equals ``warp_logits`` with
    ``SamplingParams(temperature[b], top_k[b], top_p[b])`` bit for bit on the CPU (same float32 ops;
    tested), up to kernel rounding on other devices. ``top_k`` / ``top_p`` ``None`` means off in every
    row, and skips that filter's sort over the vocabulary (the result is the same as all-0 / all-1 rows).
    """
    logits = logits.float()
    shape, greedy, scaled = _scaled_rows(logits, temperature, top_k)
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None:
        probs = _top_p_rows(probs, top_p.to(logits.device, torch.float32).reshape(shape))
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def _scaled_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor]):
    """``(broadcast shape of a per-row value, greedy rows, float32 logits / T with top-k applied)``."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    temp = temperature.to(logits.device, torch.float32).reshape(shape)
    greedy = temp == 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temp), temp)
    if top_k is not None:
        scaled = _top_k_rows(scaled, top_k.to(logits.device).reshape(shape))
    return shape, greedy, scaled


def _top_k_rows(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask logits below each row's k-th largest (rows with k == 0 or k >= vocab are kept whole)."""
    vocab = logits.shape[-1]
    k = k.long()
    ranked = torch.sort(logits, dim=-1, descending=True).values
    index = (k.clamp(1, vocab) - 1).expand(*logits.shape[:-1], 1)
    kth = ranked.gather(-1, index)
    on = (k > 0) & (k < vocab)
    return logits.masked_fill(on & (logits < kth), float("-inf"))


def _top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True outside each row's smallest prefix (by probability) reaching top_p (rows with top_p >= 1: none)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = before >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted) & (top_p < 1.0)


def _top_p_rows(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest prefix (by probability) reaching top_p, renormalized (top_p < 1 only)."""
    kept = probs.masked_fill(_top_p_drop(probs, top_p), 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.where(top_p < 1.0, kept, probs)


def filter_logits_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """``logits`` with ``-inf`` outside each sampled row's top-k / top-p set (greedy rows untouched): the same
    sorts and masks as ``warp_logits_rows``, so ``softmax(filtered / T)`` is its law (up to rounding). Lets a
    kernel that only knows temperature sample from the filtered law."""
    shape, greedy, scaled = _scaled_rows(logits, temperature, top_k)
    drop = scaled == float("-inf")
    if top_p is not None:
        drop = drop | _top_p_drop(torch.softmax(scaled, dim=-1), top_p.to(logits.device, torch.float32).reshape(shape))
    return logits.masked_fill(drop & ~greedy, float("-inf"))


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token drawn by inverse CDF: the smallest index whose cumulative probability exceeds ``u * total``.

    ``probs`` is ``[..., V]`` (non-negative, total mass > 0) and ``u`` in [0, 1) has shape ``[...]``;
    the result (long, shape ``[...]``) always has positive probability, even if ``u`` rounds to 1.
    One definition, shared by the CPU reference and the device verifier so both draw the same token.
    """
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[..., -1:]
    below = (cdf <= u.to(cdf.dtype).unsqueeze(-1) * total).sum(-1)
    last = (cdf < total).sum(-1)  # where the cdf reaches its total: the last token that adds mass
    return torch.minimum(below, last)


@dataclass
class RowSampling:
    """Per-row sampling parameters of a batch as device tensors (the engine's slots), warped in one go.

    ``temperature`` ``[B]`` (0 = greedy), ``top_k`` ``[B]`` (0 = off), ``top_p`` ``[B]`` (1 = off). ``seed`` and
    ``step`` (``[B]`` int64) key every random draw of a row: its request's seed and how many steps that request has
    taken, so a request draws the same numbers whatever else shares the batch.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: Optional[torch.Tensor] = None  # None: 0 in every row
    step: Optional[torch.Tensor] = None  # None: 0 in every row
    filtered_rows: set = field(default_factory=set)  # host-side: rows given a top-k or top-p

    def __post_init__(self):
        rows, device = self.temperature.shape[0], self.temperature.device
        self.seed = torch.zeros(rows, dtype=torch.long, device=device) if self.seed is None else self.seed
        self.step = torch.zeros(rows, dtype=torch.long, device=device) if self.step is None else self.step

    @classmethod
    def greedy(cls, batch: int, device) -> "RowSampling":
        return cls(torch.zeros(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device),
                   torch.ones(batch, device=device))

    def start(self, row: int, seed: int) -> None:
        """Key slot ``row``'s draws to a joining request's ``seed`` (any integer, taken modulo 2**64), from its
        first step."""
        if not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        value = int(seed) & (2**64 - 1)
        self.seed[row] = value - 2**64 if value >= 2**63 else value
        self.step[row] = 0

    def advance(self) -> None:
        """Every row has taken one more step (device code: part of each step's graph)."""
        self.step.add_(1)

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Give slot ``row`` the parameters of a joining request (in place: captured graphs see it)."""
        self.temperature[row] = float(params.temperature)
        self.top_k[row] = int(params.top_k)
        self.top_p[row] = float(params.top_p)
        if params.top_k > 0 or params.top_p < 1.0:
            self.filtered_rows.add(row)
        else:
            self.filtered_rows.discard(row)

    @property
    def filtered(self) -> bool:
        """Whether any row has a top-k or top-p: else warping skips both filters' sorts over the vocabulary.
        A CUDA graph captured either way is only valid while this stays the same (the engine keys on it)."""
        return bool(self.filtered_rows)

    def filters(self) -> tuple:
        """``(top_k, top_p)`` for ``warp_logits_rows``: the tensors, or ``(None, None)`` when no row filters."""
        return (self.top_k, self.top_p) if self.filtered else (None, None)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """``warp_logits_rows`` with these parameters: ``[B, ..., V]`` logits -> probabilities."""
        return warp_logits_rows(logits, self.temperature, *self.filters())
