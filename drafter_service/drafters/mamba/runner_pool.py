"""Graphed one-token runners of a draft model, kept for reuse by its sessions and their forks.

On CUDA a mamba draft session commits accepted tokens one graph replay at a time (``GraphedLM.step`` over the
runner's own static state). Capturing that graph costs more than the whole draft, so runners are not built per
session: a session (or a fork of one, drafting ahead) takes a runner of its size and gives it back on close.
"""

from __future__ import annotations

SEQLEN_BUCKET = 1024
"""Runner sizes are rounded up to a multiple of this, so sessions with nearby prompt lengths share runners."""
MAX_FREE = 64
"""Runners kept free at most (a fork's runner comes back within a step; more than this is a burst to let go)."""


def runner_size(max_seqlen: int) -> int:
    return -(-int(max_seqlen) // SEQLEN_BUCKET) * SEQLEN_BUCKET


class RunnerPool:
    """Free ``GraphedLM`` runners (batch 1) of ``model``, by size."""

    def __init__(self, model):
        self.model = model
        self.free: dict[int, list] = {}

    def take(self, max_seqlen: int):
        """A runner holding at least ``max_seqlen`` tokens (rounded up to ``SEQLEN_BUCKET``), its state zeroed."""
        from stree.verifier.model.graphed import GraphedLM

        size = runner_size(max_seqlen)
        spare = self.free.get(size)
        if spare:
            runner = spare.pop()
            runner.new_state(1, size)  # zeroed, as a new runner's
            return runner
        return GraphedLM(self.model, 1, size)

    def give(self, runner) -> None:
        spare = self.free.setdefault(runner.max_seqlen, [])
        if sum(len(v) for v in self.free.values()) < MAX_FREE:
            spare.append(runner)

    def num_free(self) -> int:
        return sum(len(v) for v in self.free.values())
