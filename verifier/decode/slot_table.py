"""Which request holds which of the engine's B slots, and the queue of requests waiting for one."""

from __future__ import annotations

import collections
from typing import Callable, Optional

from stree.verifier.decode.request import Request


class SlotTable:
    """``slots[i]``: the request in slot i (None: free); ``waiting``: requests queued for a slot, in order.
    ``on_release(i, request)`` hears every request leaving its slot; ``on_change(idle)`` every change of which
    slots are idle (a list of bools)."""

    def __init__(self, batch: int, on_release: Callable[[int, Request], None], on_change: Callable[[list], None]):
        self.slots: list[Optional[Request]] = [None] * batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.on_release, self.on_change = on_release, on_change

    def running(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is not None]

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is None]

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def any_sampled(self) -> bool:
        return any(r is not None and not r.params.greedy for r in self.slots)

    def take(self, pairs: list) -> None:
        """``(slot, request)`` pairs join."""
        for i, req in pairs:
            self.slots[i] = req
        self.changed()

    def drop_finished(self) -> None:
        """Free the slots of finished requests."""
        freed = [i for i, r in enumerate(self.slots) if r is not None and r.done]
        for i in freed:
            req, self.slots[i] = self.slots[i], None
            self.on_release(i, req)
        if freed:
            self.changed()

    def changed(self) -> None:
        self.on_change([r is None for r in self.slots])

    def next_waiting(self, n: int) -> list[Request]:
        """Up to ``n`` waiting requests, oldest first (cancelled ones are dropped)."""
        out = []
        while self.waiting and len(out) < n:
            req = self.waiting.popleft()
            if not req.done:
                out.append(req)
        return out
