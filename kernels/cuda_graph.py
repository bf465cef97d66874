"""CUDA graph capture: the one helper every graphed path uses (model steps, drafts, training, timings).

Without graphs a step of a 64-layer model is bound by kernel launches (DESIGN section 5).
"""

from __future__ import annotations

from typing import Callable

import torch


def capture_graph(fn: Callable, warmup: int = 1):
    """``(graph, outputs)``: ``fn`` run ``warmup`` times on a side stream (real runs), then captured once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
