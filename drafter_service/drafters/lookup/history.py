"""Each slot's token history on the device: the prompt and output before its root, as the lookup drafters need it.

``tokens`` is ``[B, pad + T]``: ``pad`` leading columns of -1 (no token: a match running off the start never matches)
then up to T tokens; ``length[b]`` tokens are in. Appends are scatters at fixed shapes (no host sync), so the engine's
step graph holds them: a commit appends the accepted path's tokens, a plain step its root.
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.kernels import ops

NO_TOKEN = -1


class SlotHistory:
    """Token history of ``batch`` slots, up to ``capacity`` tokens each, after ``pad`` columns of ``NO_TOKEN``."""

    def __init__(self, batch: int, capacity: int, pad: int, device):
        self.pad, self.capacity = int(pad), int(capacity)
        self.tokens = torch.full((batch, self.pad + self.capacity), NO_TOKEN, dtype=torch.long, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)

    @property
    def body(self) -> torch.Tensor:
        """``[B, T]``: the history columns (token t of slot b at ``[b, t]``)."""
        return self.tokens[:, self.pad:]

    def mutable(self) -> list[torch.Tensor]:
        return [self.tokens, self.length]

    def load(self, slot: int, context: torch.Tensor) -> None:
        """Make ``slot`` hold ``context`` (between steps)."""
        n = min(int(context.numel()), self.capacity)
        if n < int(context.numel()):
            raise ValueError(f"lookup drafter: a context of {context.numel()} tokens is over its {self.capacity}")
        self.body[slot].fill_(NO_TOKEN)
        if n:
            self.body[slot, :n] = context.to(self.tokens.device)
        self.length[slot] = n

    def rewind(self, idle: torch.Tensor) -> None:
        """Empty the slots marked in ``idle`` (``[B]`` bool)."""
        self.length.masked_fill_(idle, 0)

    def append(self, tokens: torch.Tensor, count: Optional[torch.Tensor] = None) -> None:
        """Append each slot's first ``count[b]`` tokens of ``tokens`` ``[B, L]`` (None: all L; past the capacity:
        dropped)."""
        ops.history_append(self.tokens, self.length, tokens, count, self.pad)

    def put_roots(self, roots: torch.Tensor) -> None:
        """Write each slot's root at its length (not counted in): the draft's view of the whole sequence."""
        col = self.length.clamp(max=self.capacity - 1)[:, None] + self.pad
        self.tokens.scatter_(1, col, roots[:, None])

    def recent(self, count: int, offset: int = 0) -> torch.Tensor:
        """``[B, count]``: tokens ``length - offset - j`` for ``j = 0..count-1`` (the newest first; ``NO_TOKEN`` before
        the start). With the roots put, offset 0 starts at the root."""
        steps = torch.arange(count, device=self.tokens.device)
        col = (self.length[:, None] - offset - steps[None, :] + self.pad).clamp(min=0)
        return self.tokens.gather(1, col)

    def gather(self, positions: torch.Tensor, ok: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens at ``positions`` (any shape ``[B, ...]``; clamped into the buffer; 0 where ``ok`` is False)."""
        b = positions.shape[0]
        flat = (positions.reshape(b, -1) + self.pad).clamp(0, self.tokens.shape[1] - 1)
        out = self.tokens.gather(1, flat).reshape(positions.shape)
        return out if ok is None else torch.where(ok, out, torch.zeros_like(out))
