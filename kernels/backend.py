"""Which implementation of each op runs: Triton kernels on CUDA, the PyTorch references on CPU.

``STREE_KERNELS=triton|torch|auto`` (default ``auto``) overrides; ``stree.kernels.backend.use(...)``
does the same from Python. The references are always importable; Triton is only imported when used.
"""

from __future__ import annotations

import os

import torch

_FORCED: str | None = None
CHOICES = ("auto", "triton", "torch")


def use(name: str | None) -> None:
    """Force a backend for this process (``None`` goes back to the environment/auto choice)."""
    if name is not None and name not in CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}; choose from {', '.join(CHOICES)}")
    global _FORCED
    _FORCED = name


def env_choice(env: str, choices: tuple, default: str, forced: str | None = None) -> str:
    """A kernel switch: ``forced`` (set from Python) if given, else environment variable ``env`` (``default`` when
    unset); a value outside ``choices`` is refused. ``STREE_KERNELS``, ``STREE_PDL`` and ``STREE_BLOCK_STEP`` read
    their settings through it."""
    value = forced or os.environ.get(env, default)
    if value not in choices:
        raise ValueError(f"{env}={value!r} is not one of {', '.join(choices)}")
    return value


def resolve(device: torch.device | str) -> str:
    """``'triton'`` or ``'torch'`` for tensors on ``device``."""
    name = env_choice("STREE_KERNELS", CHOICES, "auto", _FORCED)
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def capturing() -> bool:
    """True while a CUDA graph is being captured: host-side checks (which sync) must be skipped."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
