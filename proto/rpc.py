"""gRPC plumbing both stree services share: health, reflection, channel options, server start-up,
TLS credentials, the API-key check, and an asyncio event loop on a daemon thread for driving
grpc.aio code from synchronous callers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import os
import threading
from pathlib import Path
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


# Requests to a server are small (token ids, budgets): a tighter cap than responses' stops a client
# from making the server buffer hundreds of MB before any check runs.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
API_KEY_ENV = "STREE_API_KEY"
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")  # probes need no key


def server_options(max_request_bytes: int = MAX_REQUEST_BYTES) -> list:
    """SERVER_OPTIONS with the request size capped at ``max_request_bytes`` (RESOURCE_EXHAUSTED above it)."""
    opts = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    return opts + [("grpc.max_receive_message_length", int(max_request_bytes))]


def _read(path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None


def server_credentials(cert_file, key_file, client_ca_file=None) -> grpc.ServerCredentials:
    """TLS for a server (PEM files); with ``client_ca_file`` clients must show a certificate it signed (mTLS)."""
    pair = [(_read(key_file, "TLS key"), _read(cert_file, "TLS certificate"))]
    if client_ca_file is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=_read(client_ca_file, "client CA"),
                                       require_client_auth=True)


def channel_credentials(ca_file=None, cert_file=None, key_file=None) -> grpc.ChannelCredentials:
    """TLS for a client: ``ca_file`` to trust (default: the system's), a client cert/key pair for mTLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "CA certificate") if ca_file else None,
        private_key=_read(key_file, "TLS key") if key_file else None,
        certificate_chain=_read(cert_file, "TLS certificate") if cert_file else None,
    )


def api_key_from_env(explicit: Optional[str] = None) -> Optional[str]:
    """``explicit`` when given, else ``$STREE_API_KEY`` (None when neither is set or both are empty)."""
    key = explicit if explicit is not None else os.environ.get(API_KEY_ENV)
    return key or None


def auth_metadata(api_key: Optional[str]) -> tuple:
    """Call metadata carrying ``api_key`` as a bearer token (empty without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _denied(handler, message: str):
    """A handler of ``handler``'s shape that ends the call UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(requests, context):
        async def drain():
            async for _ in requests:
                continue

        # Take what the client sent right behind its first message: an aio client whose write lands after
        # the call ended reads INTERNAL instead of our status. Refusals need not be fast.
        try:
            await asyncio.wait_for(drain(), 0.1)
        except asyncio.TimeoutError:
            pass
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_stream)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health probes must carry ``authorization: Bearer <api key>`` (UNAUTHENTICATED else)."""

    def __init__(self, api_key: str, open_methods: Sequence[str] = OPEN_METHODS):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.expected = f"Bearer {api_key}".encode()
        self.open_methods = set(open_methods)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in self.open_methods:
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self.expected):
            return handler
        return _denied(handler, "missing or wrong API key (metadata 'authorization: Bearer <key>')")


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``), for per-client limits."""
    kind, _, rest = peer.partition(":")
    host = rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else rest
    return f"{kind}:{host}"


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def exposure_warnings(bind: str, has_api_key: bool, has_tls: bool) -> list[str]:
    """What a server listening on ``bind`` leaves open: no API key, no TLS (nothing on a loopback address)."""
    if is_loopback(bind):
        return []
    out = []
    if not has_api_key:
        out.append(f"listening on {bind} without an API key: anyone who can reach this address can use the "
                   f"server (--api-key or ${API_KEY_ENV})")
    if not has_tls:
        out.append(f"listening on {bind} without TLS: requests, outputs and any API key cross the network in "
                   f"clear (--tls-cert and --tls-key)")
    return out


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


async def start_server(bind: str, port: int, add_servicer, service_name: str, credentials=None,
                       api_key: Optional[str] = None, options: Optional[list] = None):
    """An aio server with ``add_servicer(server)`` plus health (NOT_SERVING until the caller is ready)
    and reflection, bound (TLS with ``credentials``; ``api_key`` required on every call but health
    probes) and started; returns ``(server, health, bound_port)``."""
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    server = grpc.aio.server(options=options or server_options(), interceptors=interceptors)
    add_servicer(server)
    health = add_health_and_reflection(server, [service_name])
    await set_serving(health, [service_name], serving=False)
    if credentials is not None:
        bound = server.add_secure_port(f"{bind}:{port}", credentials)
    else:
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


def serve_until_signalled(server, banner: str, grace: float = 2.0, stop_timeout: float = 30.0) -> None:
    """Start an aio ``server`` (``start``/``stop`` coroutines) on the shared loop and print ``banner`` (formatted
    with ``address`` and ``server``); stop it on SIGINT/SIGTERM, waiting up to ``grace + stop_timeout`` seconds
    for ``stop`` (which may drain requests in flight first)."""
    import signal

    loop = shared_loop()
    loop.run(server.start())
    print(banner.format(address=server.address, server=server), flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        loop.run(server.stop(grace), timeout=grace + stop_timeout)
