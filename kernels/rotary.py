"""Rotary position embedding (flash-attn conventions) on the first ``dim`` channels of each head.

The reference below spends about fifteen small launches per call (frequencies, cos, sin, halves,
products, concatenations); ``rotary_triton`` does the same in one. ``inv_freq`` is computed once per
(dim, base, device) by ``rotary_inv_freq`` so both paths multiply the very same float32 frequencies.
"""

from __future__ import annotations

import torch

from stree.kernels import rowwise

_INV_FREQ: dict = {}


def rotary_inv_freq(dim: int, base: float, device) -> torch.Tensor:
    """``1 / base^(2i/dim)`` for ``i < dim/2`` in float32, cached (made outside any graph capture)."""
    key = (dim, float(base), str(torch.device(device)))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    return _INV_FREQ[key]


def rotary_ref(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x`` ``[B, T, H, D]`` rotated by positions ``pos`` ``[B, T]``; channels past ``2 * len(inv_freq)`` pass."""
    dim = 2 * inv_freq.shape[0]
    if dim == 0:
        return x
    freqs = pos.float()[..., None] * inv_freq  # [B, T, dim/2]
    cos = rowwise.pointwise(torch.cos, freqs)[:, :, None, :]
    sin = rowwise.pointwise(torch.sin, freqs)[:, :, None, :]
    xr, rest = x[..., :dim].float(), x[..., dim:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : dim // 2], xr[..., dim // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)
