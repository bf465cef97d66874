"""CUDA graph capture: the one helper every graphed path uses (model steps, drafts, training, timings),
and ``graphed_us`` / ``graphed_fastest``, graphed timings of a few calls (benchmarks, and the once-per-shape
kernel choices).

Without graphs a step of a 64-layer model is bound by kernel launches (DESIGN section 5).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from typing import Callable

import torch

from stree.kernels import arrival


def capture_graph(fn: Callable, warmup: int = 1, pool=None):
    """``(graph, outputs)``: ``fn`` run ``warmup`` times on a side stream (real runs), then captured once.

    ``pool`` (``torch.cuda.graph_pool_handle()``) lets graphs that never run at once share their memory."""
    arrival.counters(torch.device("cuda", torch.cuda.current_device()))  # counters are never made mid-capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), collector_paused():
        out = fn()
    return graph, out


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off inside the block, back to its former state after.

    A collection during a capture can free an unreachable object that owns CUDA resources (an earlier engine's
    graph, say); its destructor's CUDA call is illegal while the stream captures, and the process aborts.
    ``torch.cuda.graph`` collects just before the capture begins, so nothing is left waiting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graphed_fastest(candidates: dict, default, min_gain: float = 1.0):
    """The key of ``candidates`` (key -> zero-argument call) whose call is fastest, each timed 20 times in one
    graph; ``default`` unless the fastest takes at most ``min_gain`` times ``default``'s time (ties keep the
    earlier key). The once-per-shape choices of ``linear`` and ``norm_linear`` use it."""
    times = {c: graphed_us([fn] * 20, reps=5) for c, fn in candidates.items()}
    best = min(times, key=times.get)
    return best if times[best] <= min_gain * times[default] else default


def graphed_us(calls, reps: int = 30) -> float:
    """Median microseconds per call of ``calls`` (one list entry per input set) replayed in one CUDA graph."""
    graph, _ = capture_graph(lambda: [c() for c in calls], warmup=2)
    graph.replay()
    torch.cuda.synchronize()
    times = replay_ms(graph, reps)
    del graph
    return statistics.median(times) * 1000.0 / len(calls)


def replay_ms(graph, reps: int) -> list[float]:
    """GPU milliseconds of each of ``reps`` replays of a captured ``graph`` (CUDA events, one sync per replay)."""
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def mean_replay_ms(graph, reps: int = 50) -> float:
    """Mean GPU milliseconds of one replay of a captured ``graph`` over ``reps`` back-to-back replays (one warm
    replay first): a step graph's throughput cost, where ``replay_ms`` times each replay alone."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
