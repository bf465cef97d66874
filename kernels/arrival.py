"""Zeroed int32 arrival counters for kernels whose last program to arrive finishes a shared piece of work (the
decode step's B/C conv-state roll, a split-K GEMM's ordered sum of its partial products).

One buffer per (device, stream): each launch leaves its counters at zero again, and launches on one stream never
overlap (with programmatic dependent launch a kernel still waits for the one before it before touching them). A
CUDA graph capture runs on its own stream, so each graph gets its own buffer, zeroed once inside it.
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers stay allocated: a captured graph may still use them


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device`` for the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
