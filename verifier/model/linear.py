"""``nn.Linear`` whose forward goes through ``kernels.ops.linear``: same parameters and state-dict keys,
but few-row inference on CUDA (tree passes) runs at the row count measured fastest for cuBLAS."""

from __future__ import annotations

import torch
from torch import nn

from stree.kernels import ops


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` for the model's projections (see ``kernels/linear.py`` for why)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)
