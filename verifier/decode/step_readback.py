"""A step's output on its way to the host: one asynchronous copy per step into pinned memory, and its timing.

At most two steps are in flight (the engine collects step k after launching step k+1), so three host buffers used
in turn never overwrite one that is still being read. On CUDA each turn has events for the step's start and end
(its GPU time, what goodput control measures) and for its copy's arrival; on the CPU the step ran synchronously and
its wall time is the cost.
"""

from __future__ import annotations

import time

import torch

TURNS = 3


class StepReadback:
    """Host copies of ``out`` (``[B, W]`` long: per row its tokens, then their count), used in turn."""

    def __init__(self, out: torch.Tensor, cuda: bool):
        self.out, self.cuda = out, cuda
        self.host = [torch.empty(out.shape, dtype=torch.long, pin_memory=cuda) for _ in range(TURNS)]
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), torch.cuda.Event())
                       for _ in range(TURNS)] if cuda else []
        self.wall = [0.0] * TURNS
        self.turn = 0

    def start(self) -> int:
        """Mark a step's start; returns its turn."""
        turn = self.turn
        self.turn = (turn + 1) % TURNS
        if self.cuda:
            self.events[turn][0].record(torch.cuda.current_stream(self.out.device))
        else:
            self.wall[turn] = time.perf_counter()
        return turn

    def finish(self, turn: int) -> None:
        """Mark the step's end and start copying its output to the host."""
        if self.cuda:
            start, end, arrived = self.events[turn]
            stream = torch.cuda.current_stream(self.out.device)
            end.record(stream)
            self.host[turn].copy_(self.out, non_blocking=True)
            arrived.record(stream)
        else:
            self.wall[turn] = time.perf_counter() - self.wall[turn]
            self.host[turn].copy_(self.out)

    def read(self, turn: int) -> list:
        """The step's output rows (waits for the copy)."""
        if self.cuda:
            self.events[turn][2].synchronize()
        return self.host[turn].tolist()

    def seconds(self, turn: int) -> float:
        """The step's GPU time (CUDA) or wall time (CPU); after ``read``."""
        if self.cuda:
            start, end, _ = self.events[turn]
            return start.elapsed_time(end) / 1e3
        return self.wall[turn]
