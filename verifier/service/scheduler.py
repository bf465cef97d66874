"""Continuous batching: one thread owns the Engine and steps it; requests cross in through a queue.

Front ends (gRPC, HTTP) ``submit`` ``ServedRequest``s; each joins the running batch at a step boundary,
streams tokens through its ``on_tokens`` callback (called on this thread) and is reported once through
``on_finish`` after it has left the engine (its slot is free by then).

Clients share the engine fairly. Before every step the queue is put in round-robin order over clients,
the client with the fewest running requests first, so one client's backlog never stands in front of
another client's first request; ``reserved_slots`` slots are kept for clients that run nothing yet (a
client already running a request cannot take the last of them), so a newcomer starts at the next step
boundary even while others hold long generations; and a client holds at most ``max_per_client``
requests, running and queued together.
"""

from __future__ import annotations

import collections
import heapq
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from stree.verifier.decode.engine import Engine, Request

log = logging.getLogger(__name__)

STEP_FAILED = "an engine step failed while generating this request (the server log has the details)"


@dataclass(eq=False)
class ServedRequest(Request):
    """An engine request as a server runs it: who sent it, and why it failed when it did.

    ``error_message`` (``Request``) is the client-facing reason of a ``finish_reason == "error"``; ``retryable``
    says the request itself was fine (the server shut down under it) so the client may send it again elsewhere.
    """

    client: str = ""
    retryable: bool = False


class QueueFull(Exception):
    """The server holds its maximum of running plus waiting requests."""


class ClientLimit(QueueFull):
    """This client holds its maximum of running plus waiting requests."""


def fair_order(queued: Iterable[ServedRequest], running: dict) -> list[ServedRequest]:
    """``queued`` in round-robin order over clients: each turn goes to the client with the fewest requests
    running plus already placed (``running``: client -> count), ties to the earliest arrival; a client's own
    requests keep their arrival order."""
    per_client: dict = collections.defaultdict(collections.deque)
    for req in sorted(queued, key=lambda r: r.submitted_s):
        per_client[req.client].append(req)
    load = collections.Counter(running)
    heap = [(load[c], q[0].submitted_s, c) for c, q in per_client.items()]
    heapq.heapify(heap)
    out = []
    while heap:
        _, _, client = heapq.heappop(heap)
        reqs = per_client[client]
        out.append(reqs.popleft())
        load[client] += 1
        if reqs:
            heapq.heappush(heap, (load[client], reqs[0].submitted_s, client))
    return out


def admissible(order: Sequence[ServedRequest], running: dict, free: int, reserved: int) -> tuple[list, list]:
    """Split ``order`` (fair order) into what the engine may admit into ``free`` slots now and what waits: a
    request of a client that already runs one (or got one of these slots) takes a slot only while more than
    ``reserved`` would stay free. The rest follows the admitted ones only when they fill every free slot (the
    engine's admission hold counts them then, and cannot admit them this step)."""
    load = collections.Counter(running)
    now, later = [], []
    for req in order:
        fits = len(now) < free and (load[req.client] == 0 or len(now) < free - reserved)
        (now if fits else later).append(req)
        if fits:
            load[req.client] += 1
    return (now + later, []) if len(now) == free else (now, later)


class Scheduler:
    """Steps ``engine`` on a daemon thread while any request is live; at most ``max_waiting`` wait for a slot."""

    def __init__(self, engine: Engine, max_waiting: int, max_per_client: Optional[int] = None,
                 reserved_slots: int = 0):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if not 0 <= reserved_slots < engine.batch:
            raise ValueError(f"reserved_slots must be in 0..{engine.batch - 1} (the engine has {engine.batch} "
                             f"slots), got {reserved_slots}")
        self.engine = engine
        self.max_waiting = int(max_waiting)
        self.max_per_client = max_per_client
        self.reserved_slots = int(reserved_slots)
        self._inbox: "queue.SimpleQueue[ServedRequest]" = queue.SimpleQueue()
        self._live: dict[int, tuple[ServedRequest, Optional[Callable]]] = {}
        self._per_client: collections.Counter = collections.Counter()
        self._held: list[ServedRequest] = []  # queued but kept out of the engine's queue this step
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name="stree-scheduler", daemon=True)
        self._thread.start()

    # ----- front-end side -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.engine.batch + self.max_waiting

    def room_problem(self, client: str, count: int = 1) -> Optional[QueueFull]:
        """The refusal ``count`` more requests of ``client`` would get now, or None when they fit."""
        if len(self._live) + count > self.capacity:
            return QueueFull(f"the server is busy: {self.engine.batch} requests running and "
                             f"{self.max_waiting} waiting (its limits); retry later")
        if self.max_per_client is not None and self._per_client[client] + count > self.max_per_client:
            return ClientLimit(f"this client already has {self._per_client[client]} generations running or "
                               f"queued; the limit is {self.max_per_client} per client")
        return None

    def submit(self, requests: Sequence[ServedRequest], on_finish: Optional[Callable] = None) -> None:
        """Queue ``requests`` all together, or none: raises ``QueueFull`` / ``ClientLimit`` past a bound."""
        with self._lock:
            for client, count in collections.Counter(r.client for r in requests).items():
                refusal = self.room_problem(client, count)
                if refusal is not None:
                    raise refusal
            for req in requests:
                self._live[id(req)] = (req, on_finish)
                self._per_client[req.client] += 1
        for req in requests:
            self._inbox.put(req)
        self._wake.set()

    def cancel(self, request: Request) -> None:
        """Stop ``request`` at the next step boundary (a waiting one never starts)."""
        request.cancel()
        self._wake.set()

    def end_all(self, message: str, retryable: bool) -> int:
        """End every live request with ``message`` (each leaves the engine at the next step boundary); returns
        how many were still going."""
        with self._lock:
            live = [req for req, _ in self._live.values() if not req.done]
        for req in live:
            _fail(req, message, retryable)
        self._wake.set()
        return len(live)

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
            self._arrange()
            if not self.engine.has_work:
                self._reap()
                self._wake.wait(0.5)
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - one bad step must not take the server down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(STEP_FAILED)
            self._reap()
        self._fail_all("the server stopped before this request finished")
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
                _fail(req, f"the engine refused this request: {exc}", False)

    def _arrange(self) -> None:
        """Put the engine's queue in fair order and hold back what the reserved slots keep out this step (only
        when a slot is free or about to be: with none, the engine admits nothing and the order can wait)."""
        eng = self.engine
        if any(r.done for r in eng.waiting):  # cancelled while queued: out now, so they are reported at once
            kept = [r for r in eng.waiting if not r.done]
            eng.waiting.clear()
            eng.waiting.extend(kept)
        self._held = [r for r in self._held if not r.done]
        free = sum(r is None or r.done for r in eng.slots)
        if free == 0 or not (self._held or eng.waiting):
            return
        queued = [*self._held, *eng.waiting]
        running = collections.Counter(r.client for r in eng.slots if r is not None and not r.done)
        admit, self._held = admissible(fair_order(queued, running), running, free, self.reserved_slots)
        eng.waiting.clear()
        eng.waiting.extend(admit)

    def _fail_all(self, message: str) -> None:
        self.engine.fail_all(message)
        self._held = []
        with self._lock:
            for req, _ in self._live.values():
                _fail(req, message, False)

    def _reap(self) -> None:
        """Report the requests that are done and out of the engine (slot freed, session closed)."""
        in_engine = {id(r) for r in self.engine.slots if r is not None}
        in_engine |= {id(r) for r in self.engine.waiting}
        with self._lock:
            gone = [(k, v) for k, v in self._live.items() if v[0].done and k not in in_engine]
            for k, (req, _) in gone:
                del self._live[k]
                self._per_client[req.client] -= 1
                if self._per_client[req.client] <= 0:
                    del self._per_client[req.client]
        for _, (req, on_finish) in gone:
            if not req.admitted and req.drafter_session is not None:  # never reached a slot
                _close_quietly(req)
            if on_finish is not None:
                try:
                    on_finish(req)
                except Exception:  # noqa: BLE001
                    log.exception("on_finish callback failed")


def _fail(req: Request, message: str, retryable: bool) -> None:
    """End ``req`` (unless it already ended) with ``finish_reason == "error"`` and ``message`` for its client."""
    if not req.done:
        req.fail(message)
        if isinstance(req, ServedRequest):
            req.retryable = retryable


def _close_quietly(req: Request) -> None:
    try:
        req.drafter_session.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("drafter close failed: %r", exc)
