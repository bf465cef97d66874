"""The verifier's GenerationService (grpc.aio): speculative tree decoding behind ``Generate``/``GenerateUnary``.

Each request runs a ``DecodeSession`` whose steps execute on a worker thread while the event loop
streams each step's tokens. Drafters run in-process (``EmbeddedDrafters``) or in a DrafterService
(``RemoteDrafters``); either way a failing drafter only costs speed. Cancelling the call closes the
session. Prometheus metrics use vLLM-like names (``stree:...``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stree.proto.rpc import set_serving, start_server
from stree.proto.codec import budget_from_pb, sampling_from_pb
from stree.proto.stree.v1 import generation_pb2, generation_pb2_grpc
from stree.protocols.drafter import DraftBudget, Drafter
from stree.protocols.registry import create_drafter, get_drafter_factory

from stree.protocols.drafter import DEFAULT_BUDGET
from stree.verifier.decode.loop import DecodeSession
from stree.verifier.service.remote_drafter import RemoteDrafter

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
NO_DRAFTER = "none"


# ----- drafters ----------------------------------------------------------------------------------
class EmbeddedDrafters:
    """Drafters built in this process by name (one instance per name, shared by sessions)."""

    def __init__(self, default: str, draft_model=None, options: Optional[dict] = None):
        self.default = default
        self.draft_model = draft_model
        self.options = dict(options or {})
        self._built: dict[str, Drafter] = {}
        self._lock = threading.Lock()
        if default != NO_DRAFTER:
            get_drafter_factory(default)  # fail at start-up on an unknown default

    def get(self, name: str) -> Optional[Drafter]:
        name = name or self.default
        if name == NO_DRAFTER:
            return None
        with self._lock:
            if name not in self._built:
                opts = dict(self.options)
                if self.draft_model is not None:
                    opts["draft_model"] = self.draft_model
                from stree.drafter_service.actors import filter_options

                self._built[name] = create_drafter(name, **filter_options(get_drafter_factory(name), opts))
            return self._built[name]

    def describe(self) -> str:
        return f"in-process (default {self.default})"

    async def aclose(self) -> None:
        self._built.clear()


class RemoteDrafters:
    """Drafters of a DrafterService: ``grpc://HOST:PORT/NAME`` sets the default name."""

    def __init__(self, url: str, deadline_s: float, budget: DraftBudget):
        self.remote = RemoteDrafter(url, deadline_s=deadline_s, budget=budget)
        self.default = self.remote.drafter

    def get(self, name: str) -> Optional[Drafter]:
        name = name or self.default
        if name == NO_DRAFTER:
            return None
        return self.remote if name == self.remote.drafter else self.remote.with_drafter(name)

    def describe(self) -> str:
        return f"remote {self.remote.name} (deadline {1e3 * self.remote.deadline_s:.0f} ms)"

    async def aclose(self) -> None:
        await self.remote.aclose()


# ----- metrics -----------------------------------------------------------------------------------
class ServerMetrics:
    """Prometheus metrics named like vLLM's (``stree:`` prefix), on this server's own registry."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.accepted = counter("stree:spec_decode_num_accepted_tokens", "Drafted tokens the verifier accepted")
        self.drafted = counter("stree:spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.drafts = counter("stree:spec_decode_num_drafts", "Verifier steps that checked a drafted tree")
        self.generation_tokens = counter("stree:generation_tokens", "Generated tokens")
        self.prompt_tokens = counter("stree:prompt_tokens", "Prompt tokens prefilled")
        self.fallbacks = counter("stree:drafter_fallbacks", "Steps run root-only because the drafter failed or was late")
        self._success = Counter("stree:request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.model_name = model_name
        self.running = Gauge("stree:num_requests_running", "Requests being generated", labels, registry=r).labels(model_name)
        self.ttft = Histogram(
            "stree:time_to_first_token_seconds", "Time to first token", labels, registry=r,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        ).labels(model_name)
        self.tpot = Histogram(
            "stree:time_per_output_token_seconds", "Step time divided by the tokens it emitted", labels, registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        ).labels(model_name)
        self.e2e = Histogram(
            "stree:e2e_request_latency_seconds", "Request latency", labels, registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(model_name)
        self.accept_len = Histogram(
            "stree:spec_decode_accepted_length", "Tokens emitted per verifier step", labels, registry=r,
            buckets=tuple(range(1, 17)) + (24, 32, 64),
        ).labels(model_name)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()


# ----- text ------------------------------------------------------------------------------------
class TextStream:
    """Incremental detokenizing with stop strings: emits only text that can no longer change or be cut."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.sent = 0
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(ids)
        for stop in self.stops:
            at = full.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                full, self.stopped, final = full[:at], True, True
        end = len(full)
        if not final:
            end = len(full.rstrip("\ufffd"))  # an incomplete multi-byte character
            for stop in self.stops:  # a tail that may still grow into a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if full[:end].endswith(stop[:k]):
                        end -= k
                        break
        end = max(end, self.sent)
        delta = full[self.sent:end]
        self.sent, self.text = end, full[:end]
        return delta

    def tokens_through_stop(self, ids: list[int]) -> list[int]:
        """The shortest prefix of ``ids`` whose text reaches a stop string."""
        for k in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:k])
            if any(s in text for s in self.stops):
                return ids[:k]
        return ids


# ----- the service -----------------------------------------------------------------------------
@dataclass
class ServerLimits:
    max_sessions: int = 8
    max_seq_len: int = 8192
    default_max_new_tokens: int = 128
    max_new_tokens: int = 4096
    budget: DraftBudget = field(default_factory=lambda: DEFAULT_BUDGET)


class InvalidRequest(ValueError):
    """A request the server refuses with INVALID_ARGUMENT."""


@dataclass
class _Job:
    prompt: list[int]
    params: object
    budget: DraftBudget
    max_new_tokens: int
    stop_ids: list[int]
    stops: list[str]
    drafter_name: str
    drafter: Optional[Drafter]


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, model, tokenizer, drafters, limits: ServerLimits, metrics: ServerMetrics, eos_id=None):
        self.model = model
        self.tokenizer = tokenizer
        self.drafters = drafters
        self.limits = limits
        self.metrics = metrics
        self.eos_ids = [] if eos_id is None else ([eos_id] if isinstance(eos_id, int) else list(eos_id))
        self.executor = concurrent.futures.ThreadPoolExecutor(limits.max_sessions, thread_name_prefix="stree-decode")
        self.active = 0
        self._count_lock = threading.Lock()
        self._slots = threading.Semaphore(limits.max_sessions)

    # ----- request checking --------------------------------------------------------------------
    def _job(self, req) -> _Job:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("the request has no prompt: set prompt_text or prompt_ids")
        if kind == "prompt_text":
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send prompt_ids instead of prompt_text")
            prompt = self.tokenizer.encode(req.prompt_text).ids
        else:
            prompt = list(req.prompt_ids.ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty (it must have at least one token)")
        vocab = self.model.vocab_size
        if max(prompt) >= vocab:
            raise InvalidRequest(f"prompt token id {max(prompt)} is outside the vocabulary of {vocab}")
        max_new = req.max_new_tokens or self.limits.default_max_new_tokens
        if max_new > self.limits.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens {max_new} is over the server's limit of {self.limits.max_new_tokens}")
        if len(prompt) + max_new > self.limits.max_seq_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt)} tokens; with max_new_tokens {max_new} that is over the "
                f"server's limit of {self.limits.max_seq_len} tokens"
            )
        try:
            params = sampling_from_pb(req.sampling)
        except ValueError as exc:
            raise InvalidRequest(f"bad sampling parameters: {exc}") from exc
        try:
            budget = budget_from_pb(req.budget, self.limits.budget) if req.HasField("budget") else self.limits.budget
        except ValueError as exc:
            raise InvalidRequest(f"bad draft budget: {exc}") from exc
        stops = [s for s in req.stop if s]
        if stops and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if any(t >= vocab for t in req.stop_token_ids):
            raise InvalidRequest(f"a stop token id is outside the vocabulary of {vocab}")
        try:
            drafter = self.drafters.get(req.drafter)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        name = req.drafter or self.drafters.default
        stop_ids = list(req.stop_token_ids)
        if not req.ignore_eos:
            stop_ids += [e for e in self.eos_ids if e not in stop_ids]
        return _Job(prompt, params, budget, max_new, stop_ids, stops, name, drafter)

    def _open(self, job: _Job) -> DecodeSession:
        """Open the drafter session and prefill (on a worker thread: both may block)."""
        session = None
        if job.drafter is not None:
            try:
                if isinstance(job.drafter, RemoteDrafter):
                    session = job.drafter.open(job.prompt, job.params, budget=job.budget)
                else:
                    session = job.drafter.open(job.prompt, job.params)
            except ValueError as exc:
                raise InvalidRequest(f"drafter {job.drafter_name!r}: {exc}") from exc
        try:
            return DecodeSession(self.model, job.prompt, session, job.params, job.budget, job.max_new_tokens, job.stop_ids)
        except ValueError as exc:
            if session is not None:
                session.close()
            raise InvalidRequest(str(exc)) from exc

    # ----- generation --------------------------------------------------------------------------
    async def _run(self, req, context):
        """Yields GenerateChunk messages; aborts the call with the right status on bad requests."""
        try:
            job = self._job(req)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self._slots.acquire(blocking=False):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server is running its maximum of {self.limits.max_sessions} sessions")
        with self._count_lock:
            self.active += 1
        self.metrics.running.inc()
        started = time.perf_counter()
        dec: Optional[DecodeSession] = None
        inflight: Optional[concurrent.futures.Future] = None
        try:
            inflight = self.executor.submit(self._open, job)
            try:
                dec = await asyncio.wrap_future(inflight)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.metrics.prompt_tokens.inc(len(job.prompt))
            text = TextStream(self.tokenizer, job.stops)
            ttft = None
            step_no = 0
            while not dec.done:
                before = (dec.num_draft_tokens, dec.num_accepted_draft_tokens, dec.fallbacks)
                t0 = time.perf_counter()
                inflight = self.executor.submit(dec.step)
                emitted = await asyncio.wrap_future(inflight)
                dt = time.perf_counter() - t0
                step_no += 1
                drafted = dec.num_draft_tokens - before[0]
                accepted = dec.num_accepted_draft_tokens - before[1]
                fallback = dec.fallbacks > before[2]
                self._count_step(job, drafted, accepted, fallback, emitted, dt)
                if ttft is None and emitted:
                    ttft = time.perf_counter() - started
                    self.metrics.ttft.observe(ttft)
                delta = text.update(dec.output, final=dec.done)
                if text.stopped:
                    keep = text.tokens_through_stop(dec.output)
                    emitted = emitted[: max(0, len(emitted) - (len(dec.output) - len(keep)))]
                    dec.finish(keep=len(keep))
                step = generation_pb2.StepStats(
                    step=step_no, draft_nodes=drafted + 1, accepted=accepted, fallback=fallback, step_seconds=dt
                )
                yield generation_pb2.GenerateChunk(token_ids=emitted, text=delta, step=step)
            reason = self._finish_reason(dec, job, text)
            total = time.perf_counter() - started
            stats = self._stats(dec, job, ttft or total, total)
            tail = text.update(dec.output, final=True) if not text.stopped else ""
            self.metrics.e2e.observe(total)
            self.metrics.success(reason)
            yield generation_pb2.GenerateChunk(text=tail, finished=True, finish_reason=reason, stats=stats)
        finally:
            # A cancelled call leaves its step (or open) running on the worker: free the session
            # once that is over, never under it.
            self._release_after(inflight, dec)

    def _release_after(self, inflight: Optional[concurrent.futures.Future], dec: Optional[DecodeSession]) -> None:
        def release(fut: Optional[concurrent.futures.Future]) -> None:
            session = dec
            if session is None and fut is not None and not fut.cancelled() and fut.exception() is None:
                result = fut.result()  # the open finished after the call was cancelled
                session = result if isinstance(result, DecodeSession) else None
            try:
                if session is not None:
                    session.close()
            finally:
                with self._count_lock:
                    self.active -= 1
                self.metrics.running.dec()
                self._slots.release()

        if inflight is None or inflight.done():
            release(inflight)
        else:
            inflight.add_done_callback(release)

    def _count_step(self, job: _Job, drafted: int, accepted: int, fallback: bool, emitted: list, dt: float) -> None:
        m = self.metrics
        if job.drafter is not None:
            m.drafts.inc()
            m.drafted.inc(drafted)
            m.accepted.inc(accepted)
            if fallback:
                m.fallbacks.inc()
        m.generation_tokens.inc(len(emitted))
        if emitted:
            m.accept_len.observe(len(emitted))
            m.tpot.observe(dt / len(emitted))

    def _finish_reason(self, dec: DecodeSession, job: _Job, text: TextStream) -> str:
        if text.stopped or (dec.output and dec.output[-1] in set(job.stop_ids)):
            return "stop"
        return "length"

    def _stats(self, dec: DecodeSession, job: _Job, ttft: float, total: float) -> generation_pb2.GenerationStats:
        n = len(dec.output)
        return generation_pb2.GenerationStats(
            prompt_tokens=len(job.prompt),
            generated_tokens=n,
            steps=dec.steps,
            mean_accepted_length=(n / dec.steps) if dec.steps else 0.0,
            draft_tokens=dec.num_draft_tokens,
            accepted_draft_tokens=dec.num_accepted_draft_tokens,
            fallbacks=dec.fallbacks,
            time_to_first_token_s=ttft,
            total_s=total,
            tokens_per_s=n / total if total > 0 else 0.0,
            drafter=job.drafter_name if job.drafter is not None else NO_DRAFTER,
        )

    async def Generate(self, request, context):
        async for chunk in self._run(request, context):
            yield chunk

    async def GenerateUnary(self, request, context):
        ids, text, last = [], [], None
        async for chunk in self._run(request, context):
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        return generation_pb2.GenerateResponse(
            token_ids=ids, text="".join(text), finish_reason=last.finish_reason, stats=last.stats
        )


class GenerationServer:
    """The GenerationService on ``bind:port`` (0: a free port), plus health, reflection and metrics."""

    def __init__(self, model, tokenizer=None, drafters=None, port: int = 0, bind: str = "127.0.0.1",
                 limits: ServerLimits = ServerLimits(), model_name: str = "stree", eos_id: Optional[int | list[int]] = None,
                 metrics_port: Optional[int] = None):
        self.drafters = drafters or EmbeddedDrafters(NO_DRAFTER)
        self.metrics = ServerMetrics(model_name)
        self.servicer = GenerationServicer(model, tokenizer, self.drafters, limits, self.metrics, eos_id)
        self.requested_port = port
        self.bind = bind
        self.metrics_port = metrics_port
        self.server: Optional[grpc.aio.Server] = None
        self.health = None
        self.port: Optional[int] = None
        self._http = None

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    def active_sessions(self) -> int:
        return self.servicer.active

    async def start(self) -> None:
        self.server, self.health, self.port = await start_server(  # health: NOT_SERVING until ready
            self.bind, self.requested_port,
            lambda srv: generation_pb2_grpc.add_GenerationServiceServicer_to_server(self.servicer, srv), SERVICE_NAME)
        if self.metrics_port is not None:
            from prometheus_client import start_http_server

            self._http = start_http_server(self.metrics_port, addr=self.bind, registry=self.metrics.registry)
        await set_serving(self.health, [SERVICE_NAME])
        log.info("GenerationService on %s, drafters: %s", self.address, self.drafters.describe())

    @property
    def metrics_address(self) -> Optional[str]:
        if self._http is None:
            return None
        return f"{self.bind}:{self._http[0].server_port}"

    async def stop(self, grace: Optional[float] = 1.0) -> None:
        if self.health is not None:
            await set_serving(self.health, [SERVICE_NAME], serving=False)
        if self.server is not None:
            await self.server.stop(grace)
        if self._http is not None:
            self._http[0].shutdown()
            self._http = None
        self.servicer.executor.shutdown(wait=False, cancel_futures=True)
        await self.drafters.aclose()

    async def wait(self) -> None:
        await self.server.wait_for_termination()
