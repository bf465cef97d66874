"""The engine's step kinds as typed keys, and one CUDA graph per key: captured once, replayed every step.

A capture runs the step twice for real first (``capture_graph``'s warm-up) and then times a few replays
(``costs``: what goodput control takes a shape's step to cost before its first step); every tensor those runs
advanced, and the RNG, are restored afterwards, so a capture never moves a sequence. A capture that fails
(an op a graph cannot hold) while the step itself runs eagerly turns graphs off for the engine: it runs eagerly
from then on, with the same output. A step that fails eagerly too raises, and graphs stay on.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from stree.kernels.cuda_graph import capture_graph, replay_ms
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_shape import TreeShape

log = logging.getLogger(__name__)

PLAIN, TREE, HOST, CATCH_UP = "plain", "tree", "host", "catch_up"


@dataclass(frozen=True)
class StepKey:
    """What one step graph runs.

    ``kind``: ``plain`` (one token per sequence), ``tree`` (a device drafter's ``shape``), ``host`` (host trees
    padded to ``shape``'s node bucket, verified under ``mode``, with draft laws when ``with_q``) or ``catch_up``
    (a lazy drafter eats its backlog). ``sampled``: some row samples; ``filtered``: some sampled row has top-k/top-p
    (its sorts are in the graph); ``feed`` (plain steps): the step writes its roots to the lazy drafter's backlog.
    """

    kind: str
    shape: Optional[TreeShape] = None
    sampled: bool = False
    filtered: bool = False
    feed: bool = False
    mode: Optional[DraftMode] = None
    with_q: bool = False

    @property
    def timed_shape(self) -> Optional[TreeShape]:
        """The shape goodput control prices with this graph's replay time (plain and device-drafted steps)."""
        if self.kind == PLAIN:
            return TreeShape.parse("none")
        return self.shape if self.kind == TREE else None


class StepGraphs:
    """CUDA graphs of the step kinds that ran, their timed replay cost, and the eager fallback.

    ``mutable()`` lists every tensor a step may advance (the engine's and its drafter's state); ``on_captured(key,
    seconds)`` hears each new graph's replay time.
    """

    def __init__(self, enabled: bool, device: torch.device, mutable: Callable[[], list],
                 on_captured: Optional[Callable[[StepKey, float], None]] = None):
        self.enabled = enabled
        self.device = device
        self.mutable = mutable
        self.on_captured = on_captured
        self.graphs: dict = {}
        self.costs: dict = {}  # StepKey -> seconds per replay, timed at capture
        self.failed = False

    def __len__(self) -> int:
        return len(self.graphs)

    def run(self, key: StepKey, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the step ``key`` names): replay its graph, capture it first, or run it eagerly."""
        if not self.enabled or self.failed:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(fn, key)
            except Exception as exc:  # noqa: BLE001 - a capture failure costs speed, never output
                fn()  # raises when the step itself fails (its inputs, not the capture): graphs stay on
                log.warning("step graph capture failed (%r); running eagerly from now on", exc, exc_info=True)
                self.failed = True
                return
            self.graphs[key] = graph
            if self.on_captured is not None:
                self.on_captured(key, self.costs[key])
        graph.replay()

    def _capture(self, fn: Callable[[], None], key: StepKey):
        saved = [t.clone() for t in self.mutable()]
        try:
            graph, _ = capture_graph(fn, warmup=2)
            self.costs[key] = statistics.median(replay_ms(graph, 3)) / 1e3
        finally:  # also when the capture fails: the eager fallback must start from the same state
            for t, s in zip(self.mutable(), saved):
                t.copy_(s)
        return graph
