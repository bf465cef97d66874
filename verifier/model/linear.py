"""``nn.Linear`` whose forward goes through ``kernels.ops.linear``: same parameters and state-dict keys, but
inference runs the numerics' GEMM: in exact numerics one fixed-tile GEMM whatever the row count (``kernels/gemm.py``),
in fast numerics the per-row-count fastest choice (``kernels/linear.py``)."""

from __future__ import annotations

import torch
from torch import nn

from stree.kernels import ops


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` for the model's projections (see ``kernels/gemm.py`` and ``kernels/linear.py``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)
