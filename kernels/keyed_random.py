"""Counter-based random numbers keyed by (request seed, request step, lane, index): the reference.

Every random draw of a step (the verifier's acceptance and bonus uniforms, a device drafter's Gumbel noise) is a
pure function of the row's own request seed, how many steps that request has taken, a lane naming the draw, and
the element's index. Nothing else enters: no generator state shared by the batch, no row position, no batch size.
A seeded request therefore draws the same numbers alone or among any others, in any slot, and a CUDA graph replays
them without any generator offset to track.

The hash is Wellons' ``lowbias32`` (a 32-bit bijection with low bias), applied to 64-bit keys as two 32-bit words;
all arithmetic is on non-negative int64 masked to 32 bits, so the CPU, CUDA and the Triton kernel
(``keyed_random_triton``, which derives the keys in the kernel too) give the same bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B
SALT = 0x68E31DA4  # separates the key's second word from its first

ACCEPT_LANE = 0
"""The verifier's acceptance uniform of each tree node."""
BONUS_LANE = 1
"""The verifier's uniform for the bonus or residual draw after each node."""
DRAFT_LANE = 16
"""A device drafter's draws at draft level ``l`` use lane ``DRAFT_LANE + l``."""


def mix32(x):
    """``lowbias32`` of int64 values in ``[0, 2**32)``, a tensor of them or one Python integer (the result is in the
    same range)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def lane_words(lane: int) -> tuple[int, int]:
    """The two words ``lane`` contributes to a key (host integers: nothing is copied to the device)."""
    return mix32(lane & MASK32), mix32((lane ^ SALT) & MASK32)


def row_keys(seed: torch.Tensor, step: torch.Tensor, lane: int) -> torch.Tensor:
    """``[B, 2]`` int64 key words of each row's draw in ``lane`` at its ``step`` (``seed``, ``step``: ``[B]`` int64).

    For one seed and lane, the first word is a bijection of the step, so a request never reuses a key."""
    lane_a, lane_b = lane_words(lane)
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    step = step & MASK32
    return torch.stack([mix32(lo ^ mix32(step ^ lane_a)), mix32(hi ^ mix32(step ^ lane_b))], dim=-1)


def to_uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms strictly inside (0, 1): the top 23 bits, centred in their interval. Every
    value is exact in float32 (24 bits would need a 25th for the half), so every implementation gives the same bits,
    and ``log(u)`` and ``log(1 - u)`` are finite."""
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def keyed_uniform_ref(seed: torch.Tensor, step: torch.Tensor, lane: int, n: int) -> torch.Tensor:
    """``[B, n]`` float32 uniforms: element ``i`` of row ``r`` is ``to_uniform(mix32(mix32(a ^ i) ^ b))`` with
    ``(a, b) = row_keys(seed, step, lane)[r]``."""
    keys = row_keys(seed, step, lane)
    idx = torch.arange(int(n), device=seed.device, dtype=torch.long)
    return to_uniform(mix32(mix32(keys[:, :1] ^ idx) ^ keys[:, 1:]))
