"""Which rounding the model's ops follow: ``exact`` (the default) or ``fast`` (setting ``STREE_NUMERICS``).

In ``exact`` mode a row's result never depends on how many rows share a call, where it sits, the tree it is in or
the batch: projections and the LM head go through one fixed-tile GEMM family (``gemm.py``), attention splits keys
at fixed logical positions (``exact_attention.py``), and a tree node's SSM state is the decode step's recurrence
walked along its path (``ssm_walk.py``), which the commit replays. So speculative greedy output equals plain greedy
output bit for bit in every dtype. ``fast`` keeps the kernels chosen per shape by timing, whose rounding follows
the row count and the tree shape.
"""

from __future__ import annotations

import torch

from stree.protocols import settings

ENV = settings.NUMERICS
CHOICES = settings.setting(ENV).choices


def use(name: str | None) -> None:
    """Force ``exact`` or ``fast`` for this process (``None`` goes back to ``STREE_NUMERICS``)."""
    settings.force(ENV, name)


def mode() -> str:
    """``'exact'`` or ``'fast'``."""
    return settings.value(ENV)


def exact() -> bool:
    """Whether the row-invariant ops run: the setting says ``exact`` (the default) and no gradients are being
    recorded (training runs the differentiable fast references)."""
    return mode() == "exact" and not torch.is_grad_enabled()
