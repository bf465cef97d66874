"""``WeightsHome``: the vocabulary size, device and dtype every model here reports, from its config and one weight."""

from __future__ import annotations

import torch


class WeightsHome:
    """Mixin for an ``nn.Module`` with a ``config.vocab_size`` and a ``_home_weight()`` whose device and
    dtype are the model's (its LM head or its embedding)."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self._home_weight().device

    @property
    def dtype(self) -> torch.dtype:
        return self._home_weight().dtype
