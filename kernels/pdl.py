"""Programmatic dependent launch (PDL, Hopper and later): a kernel's programs start while the kernel before it
in the stream is still finishing, and wait for it with ``griddepcontrol.wait`` only where they read its output.

In a batch-1 decode step every kernel is short, so the gap between one kernel's end and the next one's first
loads is a large share of the step. With PDL the next kernel's launch, program start-up and its weight loads
(weights are never written by a step) overlap the previous kernel's tail.

The setting ``STREE_PDL`` (``protocols/settings.py``, default ``on``) switches it for every stree Triton kernel;
the outputs are the same bits either way. A kernel that takes ``PDL`` calls ``pdl_enter`` in every program before its first load of anything a
previous kernel may write and before any store, so the chain of waits orders every launch after all earlier ones,
exactly as without PDL. The CPU interpreter has no PDL, so there it is always off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from stree.protocols import settings

ENV = settings.PDL


def use(setting: str | None) -> None:
    """Force PDL on or off for this process (``None`` goes back to ``STREE_PDL``)."""
    settings.force(ENV, setting)


def setting() -> str:
    """``'on'`` or ``'off'``: the forced setting, else ``STREE_PDL`` (a bad value is refused)."""
    return settings.value(ENV)


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")


def available(device: torch.device | None = None) -> bool:
    """Whether kernels on ``device`` (default: the current CUDA device) can be launched with PDL: a compiled (not
    interpreted) launch on a GPU of compute capability 9.0 or later, with a Triton that has grid dependency control."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device | None = None) -> dict:
    """Keyword arguments for a kernel that takes ``PDL``: ``PDL`` (its constexpr) and, when on, ``launch_pdl``."""
    on = setting() == "on" and available(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one (all its stores visible), then let the next kernel start launching."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
