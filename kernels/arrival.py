"""Zeroed int32 arrival counters for kernels whose last program to arrive finishes a shared piece of work (the
decode step's B/C conv-state roll, a split-K GEMM's ordered sum of its partial products).

One buffer per device, allocated and zeroed eagerly, never inside a CUDA graph capture: a buffer made inside a
capture is zeroed only when that graph replays, so another graph or an eager launch using it first would read
garbage, and every CUDA graph is captured on the same stream (PyTorch's default capture stream), so a buffer per
stream would be shared by every graph anyway. Each launch leaves its counters at zero again, and the launches
that use them run one after another on one stream (with programmatic dependent launch a kernel still waits for
the one before it before touching them). ``cuda_graph.capture_graph`` makes the buffer before it captures.
"""

from __future__ import annotations

import torch

RESERVED = 1 << 18
"""Counters a device's buffer holds at least (1 MB): more than any launch of the engine's shapes asks for."""

_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers stay allocated: a captured graph may still use them


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def counters(device: torch.device, n: int = RESERVED) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device``; a buffer too small is replaced eagerly, never inside a
    capture (``cuda_graph.capture_graph`` calls this first, so a capture finds the buffer made)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if _capturing(device):
            raise RuntimeError(f"arrival counters: {n} needed on {key} inside a CUDA graph capture, but only "
                               f"{0 if buf is None else buf.numel()} were made before it")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, RESERVED), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
