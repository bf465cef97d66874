"""The DrafterService gRPC server (grpc.aio): drafter sessions served by Ray actor replicas.

``DrafterServer`` wires the servicer, health and reflection; ``serve`` runs it until stopped.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import grpc

from stree.proto.stree.v1 import drafter_pb2, drafter_pb2_grpc

from .grpc_support import set_serving, start_server
from .pool import DrafterHost, PoolConfig
from .session import SessionAborted, StreamSession

log = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, host: DrafterHost, call_timeout_s: float = 30.0):
        self.host = host
        self.call_timeout_s = call_timeout_s
        self.active_streams = 0

    async def Session(self, request_iterator, context):
        # Read and write through ``context`` (one reader task, one writer): see StreamSession.
        session = StreamSession(self.host, context, self.call_timeout_s)
        self.active_streams += 1
        try:
            await session.run()
        except SessionAborted as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.active_streams -= 1


class DrafterServer:
    """A DrafterService on ``bind:port`` (port 0 picks a free one) backed by Ray actor pools."""

    def __init__(
        self,
        port: int = 0,
        bind: str = "127.0.0.1",
        drafters: Sequence[str] = (),
        options_for: Optional[Callable[[str], dict]] = None,
        pool_config: PoolConfig = PoolConfig(),
        call_timeout_s: float = 30.0,
        host: Optional[DrafterHost] = None,
    ):
        """``host``: keep serving the pools of a stopped server (restart the gRPC front, not the actors)."""
        self.requested_port = port
        self.bind = bind
        self.preload = list(drafters)
        self.host = host or DrafterHost(options_for or (lambda name: {}), pool_config)
        self.servicer = DrafterServicer(self.host, call_timeout_s)
        self.server: Optional[grpc.aio.Server] = None
        self.health = None
        self.port: Optional[int] = None

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    async def start(self) -> None:
        """Bind, start the drafters named up front, then report SERVING."""
        self.server, self.health, self.port = await start_server(  # health: NOT_SERVING until ready
            self.bind, self.requested_port,
            lambda srv: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(self.servicer, srv), SERVICE_NAME)
        for name in self.preload:
            await self.host.pool(name)
        await set_serving(self.health, [SERVICE_NAME])
        log.info("DrafterService on %s; drafters ready: %s", self.address, ", ".join(self.preload) or "(on demand)")

    def active_sessions(self) -> int:
        return self.servicer.active_streams

    async def stop(self, grace: Optional[float] = 1.0, shutdown_pools: bool = True) -> None:
        if self.health is not None:
            await set_serving(self.health, [SERVICE_NAME], serving=False)
        if self.server is not None:
            await self.server.stop(grace)
        if shutdown_pools:
            self.host.shutdown()

    async def wait(self) -> None:
        await self.server.wait_for_termination()

