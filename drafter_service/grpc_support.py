"""What both stree gRPC servers share: standard health checking, server reflection, channel options."""

from __future__ import annotations

from typing import Sequence

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
