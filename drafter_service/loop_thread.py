"""An asyncio event loop on a daemon thread, for driving grpc.aio code from synchronous callers.

The verifier's decoding loop is synchronous; ``RemoteDrafter`` and in-process servers (tests,
``stree bench rpc``) hand coroutines to this loop and wait on the result with a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Awaitable, Optional, TypeVar

T = TypeVar("T")


class LoopThread:
    """Owns one running event loop; ``submit`` schedules a coroutine, ``run`` waits for it."""

    def __init__(self, name: str = "stree-aio"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        return self.submit(coro).result(timeout)

    def call_soon(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


_SHARED: Optional[LoopThread] = None
_SHARED_LOCK = threading.Lock()


def shared_loop() -> LoopThread:
    """The process-wide loop for grpc.aio: grpc's aio poller serves one event loop per process,
    so every aio server and channel in a process (servers, RemoteDrafter) must live on this one."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED._thread.is_alive():
            _SHARED = LoopThread("stree-grpc-aio")
        return _SHARED


def serve_until_signalled(server, banner: str, grace: float = 2.0) -> None:
    """Start an aio ``server`` (``start``/``stop`` coroutines) on the shared loop; stop it on SIGINT/SIGTERM."""
    import signal

    loop = shared_loop()
    loop.run(server.start())
    print(banner.format(address=server.address), flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.run(server.stop(grace), timeout=grace + 30)
