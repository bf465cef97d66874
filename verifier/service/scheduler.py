"""Continuous batching: one thread owns the Engine and steps it; requests cross in through a queue.

Front ends (gRPC, HTTP) ``submit`` engine ``Request``s; each joins the running batch at the next
step boundary, streams tokens through its ``on_tokens`` callback (called on this thread) and is
reported once through ``on_finish`` after it has left the engine (its slot is free by then).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

from stree.verifier.decode.engine import Engine, Request

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The server holds its maximum of running plus waiting requests."""


class Scheduler:
    """Steps ``engine`` on a daemon thread while any request is live; at most ``max_waiting`` wait for a slot."""

    def __init__(self, engine: Engine, max_waiting: int):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_waiting = int(max_waiting)
        self._inbox: "queue.SimpleQueue[Request]" = queue.SimpleQueue()
        self._live: dict[int, tuple[Request, Optional[Callable]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="stree-scheduler", daemon=True)
        self._thread.start()

    # ----- front-end side -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.engine.batch + self.max_waiting

    def submit(self, request: Request, on_finish: Optional[Callable[[Request], None]] = None) -> None:
        """Queue ``request``; raises ``QueueFull`` past the bound and ``ValueError`` for a bad request."""
        with self._lock:
            if len(self._live) >= self.capacity:
                raise QueueFull(f"the server is busy: {self.engine.batch} requests running and "
                                f"{self.max_waiting} waiting (its limits); retry later")
            self._live[id(request)] = (request, on_finish)
        self._inbox.put(request)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop ``request`` at the next step boundary (a waiting one never starts)."""
        request.cancel()
        self._wake.set()

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return max(0, self.num_live - self.num_running)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ----- the scheduler thread -------------------------------------------------------------------
    def _main(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._take_inbox()
            self._drop_cancelled_waiting()
            if not self.engine.has_work:
                self._reap()
                self._wake.wait(0.5)
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - one bad step must not take the server down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all()
            self._reap()
        self._fail_all()
        self._reap()

    def _take_inbox(self) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                return
            if req.done:
                continue
            try:
                self.engine.add(req)
            except ValueError as exc:
                log.warning("request %s refused by the engine: %s", req.request_id, exc)
                req.finish_reason = "error"

    def _drop_cancelled_waiting(self) -> None:
        waiting = self.engine.waiting
        if any(r.done for r in waiting):
            kept = [r for r in waiting if not r.done]
            waiting.clear()
            waiting.extend(kept)

    def _fail_all(self) -> None:
        self.engine.fail_all("the server stopped generating")
        with self._lock:
            for req, _ in self._live.values():
                req.fail("the server stopped generating")

    def _reap(self) -> None:
        """Report the requests that are done and out of the engine (slot freed, session closed)."""
        in_engine = {id(r) for r in self.engine.slots if r is not None}
        in_engine |= {id(r) for r in self.engine.waiting}
        with self._lock:
            gone = [(k, v) for k, v in self._live.items() if v[0].done and k not in in_engine]
            for k, _ in gone:
                del self._live[k]
        for _, (req, on_finish) in gone:
            if not req.admitted and req.drafter_session is not None:  # never reached a slot
                _close_quietly(req)
            if on_finish is not None:
                try:
                    on_finish(req)
                except Exception:  # noqa: BLE001
                    log.exception("on_finish callback failed")


def _close_quietly(req: Request) -> None:
    try:
        req.drafter_session.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("drafter close failed: %r", exc)
