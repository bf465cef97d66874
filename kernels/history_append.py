"""Appending tokens to each slot's token history (the lookup drafters' ``SlotHistory``): the reference.

``buf`` is ``[B, pad + T]`` (``pad`` leading columns, then up to ``capacity = T`` tokens), ``length`` ``[B]`` how many
are in. Each slot appends its first ``count[b]`` tokens of ``new`` ``[B, L]``; tokens past the capacity are dropped and
``length`` stops at it. Fixed shapes, no host sync: the engine's step graph holds it (a plain step appends its root,
a commit the accepted path), so the Triton kernel (``history_append_triton``) does it in one launch.
"""

from __future__ import annotations

from typing import Optional

import torch


def history_append_ref(buf: torch.Tensor, length: torch.Tensor, new: torch.Tensor, count: Optional[torch.Tensor],
                       pad: int) -> None:
    """In place: append ``new[b, :count[b]]`` at ``length[b]`` in slot b (``count`` None: every token of ``new``)."""
    capacity, width = buf.shape[1] - pad, new.shape[1]
    count = torch.full_like(length, width) if count is None else count
    # column t of slot b takes new[b, t - length[b]] where that is one of its first count[b] tokens: a gather, so no
    # two writes ever meet in one column (a scatter of the dropped tokens onto the last column could undo the kept)
    j = torch.arange(capacity, device=buf.device)[None, :] - length[:, None]
    take = (j >= 0) & (j < count[:, None]) & (j < width)
    body = buf[:, pad:]
    body.copy_(torch.where(take, new.gather(1, j.clamp(0, width - 1)), body))
    length += count.clamp(min=0)
    length.clamp_(max=capacity)
