"""Which implementation of each op runs: Triton kernels on CUDA, the PyTorch references on CPU.

The setting ``STREE_KERNELS`` (``protocols/settings.py``) overrides; ``stree.kernels.backend.use(...)`` does the
same from Python. The references are always importable; Triton is only imported when used.
"""

from __future__ import annotations

import contextlib

import torch

from stree.protocols import settings

CHOICES = settings.setting(settings.KERNELS).choices


def use(name: str | None) -> None:
    """Force a backend for this process (``None`` goes back to the environment/auto choice)."""
    if name is not None and name not in CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}; choose from {', '.join(CHOICES)}")
    settings.force(settings.KERNELS, name)


def resolve(device: torch.device | str) -> str:
    """``'triton'`` or ``'torch'`` for tensors on ``device``."""
    name = settings.value(settings.KERNELS)
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def capturing() -> bool:
    """True while a CUDA graph is being captured: host-side checks (which sync) must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def using(name: str | None):
    """``use(name)`` inside the block, then back to what was forced before it."""
    before = settings.forced(settings.KERNELS)
    use(name)
    try:
        yield
    finally:
        settings.force(settings.KERNELS, before)
