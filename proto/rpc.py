"""gRPC plumbing both stree services share: health, reflection, channel options, server start-up,
and an asyncio event loop on a daemon thread for driving grpc.aio code from synchronous callers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Awaitable, Optional, Sequence, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection



# Trees with draft probabilities can be large (nodes x vocab x 4 bytes).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
]


def add_health_and_reflection(server: grpc.aio.Server, service_names: Sequence[str]):
    """Register grpc.health.v1 and reflection; call ``set_serving(..., False)`` before starting, since
    the health servicer reports the whole server ("") SERVING from the start otherwise."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        list(service_names) + [health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def set_serving(servicer, service_names: Sequence[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


async def start_server(bind: str, port: int, add_servicer, service_name: str):
    """An aio server with ``add_servicer(server)`` plus health (NOT_SERVING until the caller is ready)
    and reflection, bound and started; returns ``(server, health, bound_port)``."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(server)
    health = add_health_and_reflection(server, [service_name])
    await set_serving(health, [service_name], serving=False)
    bound = server.add_insecure_port(f"{bind}:{port}")
    if not bound:
        raise ValueError(f"cannot listen on {bind}:{port}")
    await server.start()
    return server, health, bound


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
