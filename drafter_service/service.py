"""The DrafterService gRPC server (grpc.aio): drafter sessions served by Ray actor replicas.

Each stream is one generation session placed on a replica and kept alive across replica failures:
the service keeps the session's context (prompt + commits) and re-opens it elsewhere when the
replica dies, while drafts answer UNAVAILABLE so the verifier falls back at once.

A session opened with ``overlap`` drafts ahead (``drafter.proto``): after answering a Draft, while no request waits,
it asks the replica for trees of the likeliest outcomes of the tree just sent (``lookahead.py``), one at a time as
``LookaheadControl`` finds them worth it, and streams each with its assumed tokens. A replica failure while drafting
ahead is handled as one while drafting: the session is re-opened from its context.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import grpc
from google.protobuf.message import DecodeError
from ray.exceptions import RayError

from stree.drafter_service.actors import (FAILED, INVALID, LOST, OK, DrafterHost, PoolConfig, PoolLimitReached,
                                          Replica, ReplicaPool)
from stree.drafter_service.lookahead_control import LookaheadControl
from stree.proto.codec import budget_from_pb, budget_tuple, sampling_from_pb, tree_to_pb
from stree.proto.rpc import exposure_warnings, peer_host, server_options, set_serving, start_server
from stree.proto.stree.v1 import drafter_pb2
from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget


log = logging.getLogger(__name__)

Err = drafter_pb2.DrafterError


@dataclass(frozen=True)
class ServiceLimits:
    """What one client may ask of the service (each refused with a status naming the limit)."""

    max_context_tokens: int = 262_144  # prompt + commits of one session
    max_sessions: int = 1024  # open streams, all clients together
    max_sessions_per_client: int = 256  # open streams from one client host
    max_hypotheses: int = 8  # trees drafted ahead per answered Draft (0: never draft ahead)

    @property
    def max_request_bytes(self) -> int:
        """A request carrying a whole max-size context (<= 5 bytes per varint token) plus headroom."""
        return 5 * self.max_context_tokens + 64 * 1024


_MALFORMED = object()  # a request that did not parse


class SessionAborted(Exception):
    """The stream must end with ``code`` and ``message`` (bad request or drafter cannot run)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class StreamSession:
    """Reads requests into a queue and answers them in order, skipping drafts a later request made stale."""

    def __init__(self, host: DrafterHost, context: grpc.aio.ServicerContext, call_timeout_s: float = 30.0,
                 limits: ServiceLimits = ServiceLimits()):
        self.host = host
        self.grpc_context = context
        self.call_timeout_s = call_timeout_s
        self.limits = limits
        # Issued here, never taken from the client: two streams can never share (or take over) a session.
        self.session_id = uuid.uuid4().hex
        self.label = ""  # the client's session_id, for logs only
        self.pool: Optional[ReplicaPool] = None
        self.replica: Optional[Replica] = None
        self.sampling: dict = {}
        self.budget = DEFAULT_BUDGET
        self.context: list[int] = []
        self.pending: list[int] = []  # committed here, not yet shipped to the replica
        self.reopen: Optional[asyncio.Task] = None
        self.lookahead = 0  # hypotheses drafted ahead per answered Draft (what the client asked, within the limit)
        self.control = LookaheadControl()
        self.sent_at = 0.0  # when the tree the verifier is verifying went out
        self.ahead: list[tuple[int, ...]] = []  # the assumed tokens of the trees drafted ahead of it, by rank
        self._queue: collections.deque = collections.deque()
        self._arrived = asyncio.Event()
        self._arrived_at = 0.0  # when the last Commit arrived
        self._eof = False

    # ----- stream plumbing ---------------------------------------------------------------------
    async def _read_all(self) -> None:
        try:
            while True:
                raw = await self.grpc_context.read()
                if raw is grpc.aio.EOF:
                    return
                try:
                    req = drafter_pb2.DrafterRequest.FromString(raw)
                except DecodeError:
                    req = _MALFORMED  # answered INVALID_ARGUMENT in order, after the requests before it
                if req is not _MALFORMED and req.WhichOneof("kind") == "commit":
                    self._arrived_at = time.perf_counter()
                self._queue.append(req)
                self._arrived.set()
        finally:  # end of stream, or the connection broke: the session winds down either way
            self._eof = True
            self._arrived.set()

    async def _next(self):
        while not self._queue:
            if self._eof:
                return None
            self._arrived.clear()
            await self._arrived.wait()
        return self._queue.popleft()

    def _superseded(self) -> bool:
        """A queued Commit or Draft makes the draft being handled stale."""
        return any(r is not _MALFORMED and r.WhichOneof("kind") in ("commit", "draft") for r in self._queue)

    async def _write_error(self, request_id: int, code, message: str) -> None:
        await self.grpc_context.write(
            drafter_pb2.DrafterResponse(error=Err(request_id=request_id, code=code, message=message))
        )

    async def _next_valid(self):
        """The next request (None at end of stream); a malformed one ends the stream INVALID_ARGUMENT."""
        req = await self._next()
        if req is _MALFORMED:
            raise SessionAborted(grpc.StatusCode.INVALID_ARGUMENT,
                                 "request is not a valid stree.v1.DrafterRequest (malformed protobuf or invalid UTF-8)")
        return req

    async def run(self) -> None:
        reader = asyncio.get_running_loop().create_task(self._read_all())
        try:
            first = await self._next_valid()
            if first is None:
                return
            if first.WhichOneof("kind") != "open":
                raise SessionAborted(grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be Open")
            await self._open(first.open)
            while True:
                req = await self._next_valid()
                if req is None:
                    return
                kind = req.WhichOneof("kind")
                if kind == "commit":
                    self._commit(req.commit)
                elif kind == "draft":
                    if not self._superseded():
                        await self._draft(req.draft)
                elif kind == "close":
                    return
                else:
                    raise SessionAborted(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind or 'empty'} message")
        finally:
            reader.cancel()
            self._close()

    # ----- requests ----------------------------------------------------------------------------
    async def _open(self, msg) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not msg.prompt_ids:
            raise SessionAborted(bad, "Open: the prompt must contain at least one token")
        if len(msg.prompt_ids) > self.limits.max_context_tokens:
            raise SessionAborted(bad, f"Open: prompt_ids has {len(msg.prompt_ids)} tokens, more than the limit of "
                                      f"{self.limits.max_context_tokens}")
        try:
            params = sampling_from_pb(msg.sampling)
            self.budget = budget_from_pb(msg.budget, DEFAULT_BUDGET)
        except ValueError as exc:
            raise SessionAborted(bad, f"Open: {exc}") from exc
        self.label = msg.session_id[:64]
        self.sampling = params.to_dict()
        self.context = list(msg.prompt_ids)
        self.lookahead = min(msg.overlap.max_hypotheses, self.limits.max_hypotheses) if msg.HasField("overlap") else 0
        try:
            self.pool = await self.host.pool(msg.drafter)
        except ValueError as exc:
            raise SessionAborted(bad, f"Open: {exc}") from exc
        except PoolLimitReached as exc:
            raise SessionAborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Open: {exc}") from exc
        except Exception as exc:  # the details (Ray tracebacks, paths, addresses) go to the log only
            log.warning("drafter %r failed to start: %s", msg.drafter, exc)
            raise SessionAborted(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"Open: drafter {msg.drafter!r} failed to start (see the drafter service's log)") from exc
        status, detail = await self._place(attempts=5)
        if status == INVALID:
            raise SessionAborted(bad, f"Open: {detail}")
        if status != OK:
            raise SessionAborted(grpc.StatusCode.UNAVAILABLE, f"Open: no drafter replica could take the session: {detail}")
        await self.grpc_context.write(
            drafter_pb2.DrafterResponse(
                opened=drafter_pb2.SessionOpened(session_id=self.session_id, replica=self.replica.actor_name,
                                                 max_hypotheses=self.lookahead)
            )
        )

    async def _place(self, attempts: int) -> tuple[str, str]:
        """Open the session from the tracked context on the least-loaded replica, retrying on failure."""
        detail, delay = "no replica", 0.1
        for _ in range(attempts):
            self._leave_replica()
            self.replica = self.pool.acquire(self.session_id)
            if self.replica is not None:
                snapshot = len(self.context)
                try:
                    status, detail, *granted = await self._call(
                        self.replica, self.replica.handle.open.remote(self.session_id, self.context[:snapshot],
                                                                      self.sampling, self.lookahead))
                except (RayError, asyncio.TimeoutError) as exc:
                    self.pool.report_failure(self.replica, exc)
                    log.warning("session %s: open on %s failed: %r", self.session_id, self.replica.actor_name, exc)
                    status, detail = FAILED, "the drafter replica did not answer"
                if status == OK and granted:
                    self.lookahead = granted[0]  # 0 when the drafter's sessions cannot fork
                if status in (OK, INVALID):
                    self.pending = self.context[snapshot:]
                    return status, detail
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        return FAILED, detail

    async def _call(self, replica: Replica, ref):
        """Await a replica call (``call_timeout_s`` at most), counted in the replica's ``inflight`` meanwhile."""
        replica.inflight += 1
        try:
            return await asyncio.wait_for(ref, self.call_timeout_s)
        finally:
            replica.inflight -= 1

    def _leave_replica(self) -> None:
        """Release this session's replica and drop the session there (a stalled replica runs the close
        after its pending calls, so no session is left behind on it)."""
        if self.replica is None:
            return
        self.pool.release(self.replica, self.session_id)
        try:
            self.replica.handle.close.remote(self.session_id)
        except RayError as exc:
            log.debug("close on a dead replica: %r", exc)
        self.replica = None

    def _commit(self, msg) -> None:
        expected = len(self.context) + len(msg.tokens)
        if expected > self.limits.max_context_tokens:
            raise SessionAborted(
                grpc.StatusCode.OUT_OF_RANGE,
                f"Commit: the context would reach {expected} tokens, more than the limit of "
                f"{self.limits.max_context_tokens}",
            )
        if msg.context_length != expected:
            raise SessionAborted(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"Commit: context_length {msg.context_length} but the session has {len(self.context)} "
                f"tokens + {len(msg.tokens)} committed = {expected}",
            )
        self.context.extend(msg.tokens)
        self.pending.extend(msg.tokens)

    def _start_reopen(self) -> None:
        """Re-open the session from its context on a live replica, in the background; one re-open at a time (two
        would each leave the replica the other just took)."""
        if self.reopen is not None and not self.reopen.done():
            return

        async def reopen():
            while True:
                status, detail = await self._place(attempts=3)
                replica = self.replica
                if status == OK and replica is not None:
                    log.info("session %s re-opened on %s", self.session_id, replica.actor_name)
                    return
                log.warning("session %s: re-open failed (%s); retrying", self.session_id, detail)

        self.reopen = asyncio.get_running_loop().create_task(reopen())

    async def _draft(self, msg) -> None:
        rid = msg.request_id
        if msg.context_length != len(self.context):
            await self._write_error(
                rid, Err.INVALID_ARGUMENT,
                f"Draft: context_length {msg.context_length} but the session has {len(self.context)} tokens",
            )
            return
        try:
            budget = budget_from_pb(msg.budget, self.budget) if msg.HasField("budget") else self.budget
        except ValueError as exc:
            await self._write_error(rid, Err.INVALID_ARGUMENT, f"Draft: {exc}")
            return
        if self.reopen is not None:
            if not self.reopen.done():
                await self._write_error(rid, Err.UNAVAILABLE, "session is being re-opened on a live replica")
                return
            self.reopen = None
        if self.replica is None:  # a re-open ended without a replica (cancelled or failed): start another
            self._start_reopen()
            await self._write_error(rid, Err.UNAVAILABLE, "session is being re-opened on a live replica")
            return
        replica, shipped = self.replica, self.pending
        self.pending = []
        ahead, self.ahead = self.ahead, []
        t0 = time.perf_counter()
        try:
            result = await self._call(
                replica, replica.handle.draft.remote(self.session_id, shipped, len(self.context), budget_tuple(budget)))
        except (RayError, asyncio.TimeoutError) as exc:
            self.pool.report_failure(replica, exc)
            log.warning("session %s: draft on %s failed: %r", self.session_id, replica.actor_name, exc)
            self._start_reopen()
            await self._write_error(rid, Err.UNAVAILABLE, "the drafter replica failed; the session is being re-opened")
            return
        status = result[0]
        if status == OK:
            _, drafted, seconds, hit = result
            if self.lookahead and self.sent_at and shipped:
                rank = ahead.index(tuple(shipped)) if hit and tuple(shipped) in ahead else None
                # a commit that came before the tree went out (the verifier stepped without it) had no window
                self.control.observed(max(0.0, self._arrived_at - self.sent_at), len(ahead), rank)
            if not hit:
                self.control.drafted_fresh(time.perf_counter() - t0)
            if not (msg.predrafted and hit):  # else the verifier holds this very tree already
                try:
                    tree = tree_to_pb(drafted, rid, len(self.context), seconds)
                except ValueError as exc:
                    await self._write_error(rid, Err.DRAFTER_FAILED, str(exc))
                    return
                await self.grpc_context.write(drafter_pb2.DrafterResponse(tree=tree))
            self.sent_at = time.perf_counter()
            await self._draft_ahead()
            return
        # LOST: the replica restarted; FAILED: the plugin raised (session dropped); INVALID: the
        # replica's context length disagrees with ours. Each way, re-open from the tracked context.
        self._start_reopen()
        code = Err.DRAFTER_FAILED if status == FAILED else Err.UNAVAILABLE
        log.debug("draft %s of session %s: %s after %.1f ms", rid, self.session_id, result[1], 1e3 * (time.perf_counter() - t0))
        await self._write_error(rid, code, result[1])

    async def _draft_ahead(self) -> None:
        """Stream trees for the likeliest outcomes of the tree just sent, while no request waits and the replica
        serves no other session's call, as long as ``LookaheadControl`` finds the next one worth drafting."""
        replica, length = self.replica, len(self.context)
        for rank in range(self.lookahead):
            if self._queue or self._eof or replica.inflight or not self.control.worth(rank, time.perf_counter()
                                                                                      - self.sent_at):
                return
            t0 = time.perf_counter()
            try:
                result = await self._call(replica, replica.handle.ahead.remote(self.session_id, length))
            except (RayError, asyncio.TimeoutError) as exc:
                self.pool.report_failure(replica, exc)
                log.warning("session %s: drafting ahead on %s failed: %r", self.session_id, replica.actor_name, exc)
                self._start_reopen()
                return
            if result[0] != OK:
                if result[0] in (LOST, FAILED):
                    self._start_reopen()
                return
            _, tokens, drafted, seconds = result
            self.control.drafted(rank, time.perf_counter() - t0)
            try:
                tree = tree_to_pb(drafted, 0, length + len(tokens), seconds, tokens)
            except ValueError as exc:
                log.warning("session %s: a tree drafted ahead does not fit the wire: %s", self.session_id, exc)
                return
            self.ahead.append(tuple(tokens))
            await self.grpc_context.write(drafter_pb2.DrafterResponse(tree=tree))

    def _close(self) -> None:
        if self.reopen is not None:
            self.reopen.cancel()
        if self.pool is not None:
            self._leave_replica()


SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name


class DrafterServicer:
    """``Session`` streams, at most ``limits.max_sessions`` at once (and per client host)."""

    def __init__(self, host: DrafterHost, call_timeout_s: float = 30.0, limits: ServiceLimits = ServiceLimits()):
        self.host = host
        self.call_timeout_s = call_timeout_s
        self.limits = limits
        self.active_streams = 0
        self.per_client: collections.Counter = collections.Counter()

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register ``Session`` taking raw bytes, so a malformed request is ours to answer (INVALID_ARGUMENT)."""
        handler = grpc.stream_stream_rpc_method_handler(
            self.Session, request_deserializer=None,
            response_serializer=drafter_pb2.DrafterResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Session": handler}),))

    async def Session(self, request_iterator, context):
        # Read and write through ``context`` (one reader task, one writer): see StreamSession.
        client = peer_host(context.peer())
        if self.active_streams >= self.limits.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the service has {self.active_streams} open sessions, its limit")
        if self.per_client[client] >= self.limits.max_sessions_per_client:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this client has {self.per_client[client]} open sessions, the per-client limit")
        session = StreamSession(self.host, context, self.call_timeout_s, self.limits)
        self.active_streams += 1
        self.per_client[client] += 1
        try:
            await session.run()
        except SessionAborted as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.active_streams -= 1
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]


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
        limits: ServiceLimits = ServiceLimits(),
        credentials: Optional[grpc.ServerCredentials] = None,
        api_key: Optional[str] = None,
        on_demand: bool = False,
    ):
        """``host``: keep serving the pools of a stopped server (restart the gRPC front, not the actors).
        Only ``drafters`` are served unless ``on_demand`` (then any registered name, up to the host's
        pool limit); ``credentials``: TLS; ``api_key``: required as a bearer token on every call."""
        self.requested_port = port
        self.bind = bind
        self.preload = list(drafters)
        served = None if on_demand or not self.preload else self.preload
        self.host = host or DrafterHost(options_for or (lambda name: {}), pool_config, served=served)
        self.limits = limits
        self.credentials = credentials
        self.api_key = api_key
        self.servicer = DrafterServicer(self.host, call_timeout_s, limits)
        self.server: Optional[grpc.aio.Server] = None
        self.health = None
        self.port: Optional[int] = None

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    async def start(self) -> None:
        """Bind, start the drafters named up front, then report SERVING."""
        self.server, self.health, self.port = await start_server(  # health: NOT_SERVING until ready
            self.bind, self.requested_port, self.servicer.add_to, SERVICE_NAME, credentials=self.credentials,
            api_key=self.api_key, options=server_options(self.limits.max_request_bytes))
        for name in self.preload:
            await self.host.pool(name)
        for warning in exposure_warnings(self.bind, bool(self.api_key), self.credentials is not None):
            log.warning("%s", warning)
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
