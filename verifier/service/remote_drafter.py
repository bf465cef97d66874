"""``RemoteDrafter``: the Drafter/DrafterSession protocol over a DrafterService bidirectional stream.

Every ``draft`` waits at most ``deadline_s``; on timeout, a dead service or a malformed tree it
raises ``DraftUnavailable`` and the decoding loop runs that step root-only (output unchanged).
Pipelining: ``commit`` sends Commit and at once the Draft for the next step (and ``open`` sends
the first Draft right behind Open), so the drafter works while the verifier streams tokens and
prefills; ``draft`` then usually finds its tree already there. Trees drafted from a context the
verifier has moved past are dropped by their ``context_length``. When the stream dies the
session re-opens itself from its context (with backoff) and drafting resumes.

Overlap (``overlap`` > 0 hypotheses): the service drafts ahead while this verifier verifies, streaming trees for the
likeliest outcomes of the tree in flight, each with the tokens it assumes get committed (``drafter.proto``). When a
commit equals one of them (a hit), that tree is the next ``draft``'s at once, and the Draft sent with the commit says
``predrafted`` so the service moves its session to that hypothesis without sending the tree again; otherwise (a
miss) the Draft is answered as without overlap. A tree drafted ahead that arrives after its commit is still taken.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import uuid
from typing import Optional, Sequence
from urllib.parse import urlparse

import grpc

from stree.proto.rpc import CHANNEL_OPTIONS, api_key_from_env, auth_metadata, channel_credentials
from stree.proto.rpc import LoopThread, shared_loop
from stree.proto.codec import budget_to_pb, sampling_to_pb, tree_from_pb
from stree.proto.stree.v1 import drafter_pb2, drafter_pb2_grpc
from stree.protocols.drafter import DraftBudget, HostDrafter
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 0.05
TLS_CA_ENV = "STREE_TLS_CA"  # a CA file to trust for grpcs:// drafters when none is passed
# How long ``open`` waits for the service to accept a session: a stalled service must cost a request
# a fraction of a second, not seconds (drafting starts later, once the Opened answer arrives).
DEFAULT_OPEN_TIMEOUT_S = 0.2
MAX_OVERLAP = 64
"""Most trees a verifier may ask the service to draft ahead per step (the service grants at most its own limit)."""
REMOTE_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_REJECTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE)


class DraftUnavailable(RuntimeError):
    """No usable tree this step (late, service down, drafter error, malformed tree)."""


def parse_drafter_url(url: str) -> tuple[str, str]:
    """``grpc://HOST:PORT/NAME`` or ``grpcs://`` (TLS) -> (``HOST:PORT``, ``NAME``); ``ValueError`` when malformed."""
    parsed = urlparse(url)
    name = parsed.path.strip("/")
    if parsed.scheme not in ("grpc", "grpcs") or not parsed.netloc or not name or "/" in name:
        raise ValueError(f"a remote drafter is grpc://HOST:PORT/NAME, got {url!r}")
    if parsed.port is None:
        raise ValueError(f"remote drafter {url!r} needs a port (grpc://HOST:PORT/NAME)")
    return parsed.netloc, name


class RemoteDrafter(HostDrafter):
    """A drafter served by a DrafterService at ``address``; ``open`` starts one stream per session."""

    def __init__(
        self,
        address: str,
        drafter: Optional[str] = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
        open_timeout_s: Optional[float] = None,
        budget: Optional[DraftBudget] = None,
        pipeline: bool = True,
        loop: Optional[LoopThread] = None,
        tls: bool = False,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
        api_key: Optional[str] = None,
        overlap: int = 0,
    ):
        """``open_timeout_s``: default the larger of ``DEFAULT_OPEN_TIMEOUT_S`` and ``deadline_s``. ``overlap``: trees the
        service may draft ahead per step (0: none; a service that does not draft ahead ignores it).
        ``grpcs://`` addresses or ``tls``: TLS, trusting ``ca_file`` (default ``$STREE_TLS_CA``, else the system's CAs), with
        ``cert_file``/``key_file`` for mTLS; ``api_key`` (default ``$STREE_API_KEY``) as a bearer token."""
        if address.startswith(("grpc://", "grpcs://")):
            tls = tls or address.startswith("grpcs://")
            address, url_name = parse_drafter_url(address)
            drafter = drafter or url_name
        if not drafter:
            raise ValueError("RemoteDrafter needs a drafter name (grpc://HOST:PORT/NAME or drafter=)")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= MAX_OVERLAP:
            raise ValueError(f"overlap must be a whole number of hypotheses from 0 to {MAX_OVERLAP}, got {overlap!r}")
        if tls and not ca_file:
            ca_file = os.environ.get(TLS_CA_ENV) or None
        if open_timeout_s is None:
            open_timeout_s = max(DEFAULT_OPEN_TIMEOUT_S, deadline_s)
        if not open_timeout_s > 0:
            raise ValueError(f"open_timeout_s must be > 0, got {open_timeout_s}")
        self.address = address
        self.drafter = drafter
        self.scheme = "grpcs" if tls or ca_file or cert_file else "grpc"
        self.credentials = channel_credentials(ca_file, cert_file, key_file) if self.scheme == "grpcs" else None
        self.metadata = auth_metadata(api_key_from_env(api_key))
        self.name = f"{self.scheme}://{address}/{drafter}"
        self.deadline_s = deadline_s
        self.open_timeout_s = open_timeout_s
        self.budget = budget
        self.pipeline = pipeline
        self.overlap = overlap
        # the stats of every closed session opened through this drafter (and its ``with_drafter`` copies), summed
        self.totals: collections.Counter = collections.Counter()
        self._totals_lock = threading.Lock()
        self.loop = loop or shared_loop()
        self.channel: grpc.aio.Channel = self.loop.run(self._make_channel(), timeout=10)
        self.stub = drafter_pb2_grpc.DrafterServiceStub(self.channel)
        self._owner = True

    async def _make_channel(self) -> grpc.aio.Channel:
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.credentials, options=REMOTE_CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(self.address, options=REMOTE_CHANNEL_OPTIONS)

    def with_drafter(self, drafter: str) -> "RemoteDrafter":
        """The same service and channel, another drafter name."""
        other = object.__new__(RemoteDrafter)
        other.__dict__.update(self.__dict__)
        other.drafter, other.name, other._owner = drafter, f"{self.scheme}://{self.address}/{drafter}", False
        return other

    def open(
        self, prompt_ids: Sequence[int], params: SamplingParams, budget: Optional[DraftBudget] = None
    ) -> "RemoteDrafterSession":
        """Open a session; ``ValueError`` if the service rejects it (unknown drafter, bad params).

        ``budget`` (default: the drafter's) is the session's default budget and lets the first Draft
        go out right behind Open, overlapping the target's prefill.
        """
        session = RemoteDrafterSession(self, [int(t) for t in prompt_ids], params, budget or self.budget)
        session.start()
        return session

    async def aclose(self) -> None:
        """Close the channel (sessions opened from it end too); ``with_drafter`` copies leave it open."""
        if self._owner:
            self._owner = False
            await self.channel.close()

    def close(self) -> None:
        """``aclose`` from a thread other than the loop's."""
        self.loop.run(self.aclose(), timeout=5)


class RemoteDrafterSession:
    """One generation's stream. Public methods run on the caller's thread; I/O runs on the loop thread."""

    def __init__(
        self, drafter: RemoteDrafter, prompt_ids: list[int], params: SamplingParams, budget: Optional[DraftBudget] = None
    ):
        if not prompt_ids:
            raise ValueError("a drafter session needs a non-empty prompt")
        self.remote = drafter
        self.params = params
        self.session_id = uuid.uuid4().hex[:12]
        self.context = prompt_ids
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        # request id -> (context length, budget, future of the DraftTree message)
        self._requests: dict[int, tuple[int, DraftBudget, concurrent.futures.Future]] = {}
        self.budget = budget
        self._last_budget: Optional[DraftBudget] = budget
        self._opened: Optional[concurrent.futures.Future] = None
        self._out: Optional[asyncio.Queue] = None
        self._tasks: list[asyncio.Task] = []
        self._call = None
        self._live = False  # an Opened answer came back on the current stream
        self._broken: Optional[str] = None
        self._retry_at = 0.0
        self._backoff = 0.1
        self._closed = False
        self.granted = 0  # trees the service drafts ahead per step (SessionOpened.max_hypotheses)
        self._ahead: dict[tuple[int, tuple[int, ...]], object] = {}  # (context length, assumed tokens) -> DraftTree
        self._ready = None  # a tree drafted ahead whose hypothesis came true: the next draft's
        self.stats = {"drafts": 0, "trees": 0, "timeouts": 0, "errors": 0, "stale": 0, "reconnects": 0, "prefetched": 0,
                      "prefetch_hits": 0, "ahead_trees": 0, "overlap_hits": 0, "overlap_late_hits": 0,
                      "overlap_commits": 0, "waits": 0, "wait_s": 0.0, "replica_draft_s": 0.0}

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Open the stream and wait (``open_timeout_s``) for the service to accept the session."""
        opened = self._connect()
        try:
            opened.result(self.remote.open_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REJECTED:
                self.close()
                log.info("drafter service %s rejected the session: %s", self.remote.address, exc.details())
                raise ValueError(f"the drafter service rejected the session: {exc.details()}") from exc
            log.warning("drafter service %s unavailable (%s); drafting will retry", self.remote.address, exc.details())
        except DraftUnavailable as exc:
            log.warning("drafter service %s: %s; drafting will retry", self.remote.address, exc)
        except concurrent.futures.TimeoutError:
            log.warning("drafter service %s did not open the session within %.1fs; continuing without drafts until it does",
                        self.remote.address, self.remote.open_timeout_s)

    def _connect(self) -> concurrent.futures.Future:
        """Start a fresh stream with Open (+ the first Draft when pipelining); returns the Opened future."""
        self._opened = concurrent.futures.Future()
        self._live = False
        self._broken = None
        with self._lock:
            self._ahead.clear()
            prompt = list(self.context)
        open_msg = drafter_pb2.OpenSession(
            session_id=self.session_id,
            prompt_ids=prompt,
            drafter=self.remote.drafter,
            sampling=sampling_to_pb(self.params),
        )
        if self.remote.overlap:
            open_msg.overlap.max_hypotheses = self.remote.overlap
        if self.budget is not None:
            open_msg.budget.CopyFrom(budget_to_pb(self.budget))
        first = [drafter_pb2.DrafterRequest(open=open_msg)]
        if self.remote.pipeline and self._last_budget is not None:
            first.append(self._draft_request(self._last_budget, prefetch=True)[0])
        opened = self._opened
        self.remote.loop.call_soon(self._start_stream, first, opened)
        return opened

    def _start_stream(self, first: list, opened: concurrent.futures.Future) -> None:
        for task in self._tasks:
            task.cancel()
        self._out = asyncio.Queue()
        for req in first:
            self._out.put_nowait(req)
        self._call = self.remote.stub.Session(wait_for_ready=False, metadata=self.remote.metadata)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer(self._call, self._out)),
                       loop.create_task(self._reader(self._call, opened))]

    async def _writer(self, call, out: asyncio.Queue) -> None:
        try:
            while True:
                req = await out.get()
                if req is None:
                    await call.done_writing()
                    return
                await call.write(req)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("session %s: write failed: %r", self.session_id, exc)

    async def _reader(self, call, opened: concurrent.futures.Future) -> None:
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    self._fail_stream("the drafter service ended the stream", opened)
                    return
                kind = resp.WhichOneof("kind")
                if kind == "tree" and resp.tree.assumed_tokens:
                    self._drafted_ahead(resp.tree)
                elif kind == "tree":
                    self._resolve(resp.tree.request_id, resp.tree, None)
                elif kind == "error":
                    err = resp.error
                    name = drafter_pb2.DrafterError.Code.Name(err.code)
                    self._resolve(err.request_id, None, DraftUnavailable(f"drafter service: {name}: {err.message}"))
                elif kind == "opened":
                    self.granted = resp.opened.max_hypotheses
                    self._live = True
                    self._backoff = 0.1
                    if not opened.done():
                        opened.set_result(resp.opened)
        except grpc.aio.AioRpcError as exc:
            if not opened.done():
                opened.set_exception(exc)
            self._fail_stream(f"stream failed: {exc.code().name}: {exc.details()}", opened)
        except asyncio.CancelledError:
            raise

    def _fail_stream(self, why: str, opened: concurrent.futures.Future) -> None:
        if not opened.done():
            opened.set_exception(DraftUnavailable(why))
        if self._closed:
            return
        self._live = False
        self._broken = why
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 2.0)
        with self._lock:
            pending = list(self._requests.values())
            self._requests.clear()
        for _, _, fut in pending:
            if not fut.done():
                fut.set_exception(DraftUnavailable(why))

    def _drafted_ahead(self, tree) -> None:
        """A tree drafted ahead: kept for the commit it assumes, or, when that commit has already come, taken now
        (by the draft waiting for this context, else the next one)."""
        assumed = tuple(tree.assumed_tokens)
        self.stats["ahead_trees"] += 1
        waiting = None
        with self._lock:
            length = len(self.context)
            if tree.context_length > length:
                self._ahead[(tree.context_length, assumed)] = tree
                return
            if tree.context_length < length or tuple(self.context[-len(assumed):]) != assumed or self._ready is not None:
                self.stats["stale"] += 1
                return
            for rid, (want, _, fut) in self._requests.items():
                if want == length and not fut.done():
                    waiting = fut
            if waiting is None:
                self._ready = tree
            self.stats["overlap_late_hits"] += 1
        if waiting is not None:
            waiting.set_result(tree)

    def _match_ahead(self) -> bool:
        """(Under the lock, right after a commit) take the tree drafted ahead for the context as it is now."""
        length = len(self.context)
        for (want, assumed), tree in self._ahead.items():
            if want == length and tuple(self.context[-len(assumed):]) == assumed:
                self._ready = tree
                break
        self._ahead.clear()
        return self._ready is not None

    def _resolve(self, rid: int, tree, exc: Optional[Exception]) -> None:
        # The entry stays until a newer request replaces it: a prefetched tree waits there for draft().
        with self._lock:
            entry = self._requests.get(rid)
        if entry is None or entry[2].done():
            self.stats["stale"] += 1
            return
        length, _, fut = entry
        if tree is not None and tree.context_length != length:
            fut.set_exception(DraftUnavailable(f"tree for context {tree.context_length}, asked for {length}"))
        elif exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(tree)

    # ----- requests (caller's thread) ---------------------------------------------------------
    def _draft_request(self, budget: DraftBudget, prefetch: bool = False, predrafted: bool = False):
        """A Draft for the current context, registered as the one request still awaited (none when ``predrafted``:
        the verifier holds its tree already): (message, future or None)."""
        rid = next(self._rids)
        fut: Optional[concurrent.futures.Future] = None if predrafted else concurrent.futures.Future()
        with self._lock:
            # Only the newest request can still matter: forget older ones (their trees are stale).
            for old in self._requests.values():
                old[2].cancel()
            self._requests = {rid: (len(self.context), budget, fut)} if fut is not None else {}
        if prefetch and not predrafted:
            self.stats["prefetched"] += 1
        req = drafter_pb2.DrafterRequest(
            draft=drafter_pb2.DraftRequest(request_id=rid, context_length=len(self.context), budget=budget_to_pb(budget),
                                           predrafted=predrafted)
        )
        return req, fut

    def _send(self, *reqs) -> None:
        out = self._out
        for req in reqs:
            self.remote.loop.call_soon(out.put_nowait, req)

    def _waiting_for(self, budget: DraftBudget) -> Optional[concurrent.futures.Future]:
        with self._lock:
            for length, b, fut in self._requests.values():
                if length == len(self.context) and b == budget and not fut.cancelled():
                    return fut
        return None

    def tree_ready(self, budget: DraftBudget) -> bool:
        """Whether the tree for the current context and ``budget`` has already arrived (a prefetch hit)."""
        fut = self._waiting_for(budget)
        return fut is not None and fut.done() and not fut.cancelled()

    def _take_ready(self, budget: DraftBudget) -> Optional[TokenTree]:
        """The tree drafted ahead for the current context, if one came true and fits ``budget``."""
        with self._lock:
            msg, self._ready = self._ready, None
            if msg is None or msg.context_length != len(self.context):
                return None
        try:
            tree = tree_from_pb(msg)
        except ValueError as exc:
            self.stats["errors"] += 1
            log.debug("session %s: malformed tree drafted ahead: %s", self.session_id, exc)
            return None
        return tree if budget.violation(tree) is None else None

    def draft(self, budget: DraftBudget) -> TokenTree:
        """The tree for the current context within ``deadline_s``, else ``DraftUnavailable``."""
        if self._closed:
            raise DraftUnavailable("session is closed")
        self.stats["drafts"] += 1
        self._last_budget = budget
        ready = self._take_ready(budget)
        if ready is not None:
            self.stats["trees"] += 1
            return ready
        if not self._live and self._broken is None and self._opened is not None:
            try:  # still opening: wait for it within this draft's deadline
                self._opened.result(self.remote.deadline_s)
            except Exception as exc:  # noqa: BLE001 - late or failed: this step goes without a draft
                log.debug("session %s not open yet: %r", self.session_id, exc)
        if not self._live:
            if self._broken is not None and time.monotonic() >= self._retry_at:
                self.stats["reconnects"] += 1
                self._connect()
            if not self._live:
                raise DraftUnavailable(f"drafter service not connected ({self._broken or 'opening'})")
        fut = self._waiting_for(budget)
        if fut is None:
            req, fut = self._draft_request(budget)
            self._send(req)
        elif fut.done():
            self.stats["prefetch_hits"] += 1
        t0 = time.perf_counter()
        try:
            msg = fut.result(self.remote.deadline_s)
        except concurrent.futures.TimeoutError:
            self.stats["timeouts"] += 1
            raise DraftUnavailable(f"no tree within the {1e3 * self.remote.deadline_s:.0f} ms deadline") from None
        except (DraftUnavailable, concurrent.futures.CancelledError) as exc:
            self.stats["errors"] += 1
            raise DraftUnavailable(str(exc) or "draft request superseded") from None
        try:
            tree = tree_from_pb(msg)
        except ValueError as exc:
            self.stats["errors"] += 1
            raise DraftUnavailable(f"malformed tree from the drafter service: {exc}") from None
        self.stats["trees"] += 1
        self.stats["waits"] += 1
        self.stats["wait_s"] += time.perf_counter() - t0  # the step waited this long for the tree
        self.stats["replica_draft_s"] += msg.draft_seconds  # of which the replica drafted this long
        return tree

    def commit(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens; sends Commit and (pipelining) the next Draft without waiting."""
        tokens = [int(t) for t in tokens]
        if self._closed or not tokens:
            return
        with self._lock:
            self._ready = None
            self.context.extend(tokens)
            hit = self._match_ahead()
        if self.granted:
            self.stats["overlap_commits"] += 1
            self.stats["overlap_hits"] += hit
        if self._out is None or self._broken is not None:
            return  # the reconnect re-opens from the whole context
        reqs = [drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitTokens(tokens=tokens, context_length=len(self.context)))]
        if hit and self._last_budget is not None:  # the service moves its session to the hypothesis; no tree back
            reqs.append(self._draft_request(self._last_budget, predrafted=True)[0])
        elif self.remote.pipeline and self._last_budget is not None:
            reqs.append(self._draft_request(self._last_budget, prefetch=True)[0])
        else:
            with self._lock:
                self._requests.clear()
        self._send(*reqs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.remote._totals_lock:
            self.remote.totals.update(self.stats)
        with self._lock:
            for _, _, fut in self._requests.values():
                fut.cancel()
            self._requests.clear()
        if self._out is not None:
            self._send(drafter_pb2.DrafterRequest(close=drafter_pb2.CloseSession()), None)
        tasks = self._tasks
        self.remote.loop.call_soon(self._finish, tasks)

    def _finish(self, tasks) -> None:
        async def later():
            # Let the writer flush Close; then drop the reader (the server ends the stream too).
            await asyncio.sleep(0.5)
            for task in tasks:
                task.cancel()

        asyncio.get_running_loop().create_task(later())
