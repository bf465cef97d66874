"""What both front ends share: request checks, the one Engine + Scheduler, and a request's event stream.

``ServingCore.prepare`` checks and tokenizes a ``GenSpec`` on a worker thread (the tokenizer's batch call
releases the GIL, so a long prompt stalls neither the event loop nor the engine thread), after its size
was checked against the byte cap. ``ServingCore.admit`` opens the drafter sessions and submits a request's
jobs to the scheduler together, so a refusal (queue full, the client's cap, draining) comes before any
byte of a response; each ``Generation`` then yields ``Event``s (tokens, text, step stats), the last one
finished with totals. Leaving the iterator early cancels the request, which frees its slot at the next
step boundary. Every submitted request is counted once in ``stree:request_success`` (``abort`` when the
client left, ``error`` when it failed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional

from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget, Drafter, session_params
from stree.protocols.request_limits import (
    FieldError,
    check_prompt_ids,
    check_prompt_size,
    check_stop_ids,
    log_field,
    prompt_byte_limit,
)
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS, Engine, Request
from stree.verifier.decode.loop import device_offer
from stree.verifier.service.client import StreamChunk
from stree.verifier.service.drafters import NO_DRAFTER, RemoteDrafters
from stree.verifier.service.metrics import ServerMetrics
from stree.verifier.service.remote_drafter import RemoteDrafter
from stree.verifier.service.scheduler import QueueFull, Scheduler, ServedRequest
from stree.verifier.service.text import TextStream

log = logging.getLogger("stree.requests")


@dataclass
class ServerLimits:
    """Every bound a server enforces; each is a ``stree serve`` flag."""

    max_sessions: int = 8  # engine slots (requests generated together)
    max_waiting: int = 64  # requests queued for a slot; past that RESOURCE_EXHAUSTED / HTTP 429
    max_seq_len: int = 8192  # prompt + new tokens
    default_max_new_tokens: int = 128
    max_new_tokens: int = 4096
    max_prompt_chars: int = 4_000_000
    max_num_samples: int = 4  # OpenAI ``n``
    max_streams_per_client: int = 16  # running + queued generations of one client address, gRPC and HTTP
    prefill_chunk: int = 512
    admit_hold_steps: int = ADMIT_HOLD_STEPS  # steps free slots may wait to batch queued prompts' prefills
    budget: DraftBudget = field(default_factory=lambda: DEFAULT_BUDGET)
    max_prompt_bytes: Optional[int] = None  # None: max_seq_len x the longest token's bytes (at most 8)
    max_body_bytes: Optional[int] = None  # HTTP request body; None: room for the largest prompt, JSON-escaped
    body_timeout_s: float = 30.0  # an HTTP body must arrive within this
    reserved_slots: Optional[int] = None  # slots kept for clients running nothing yet; None: max_sessions // 8


class InvalidRequest(FieldError):
    """A request the server refuses (INVALID_ARGUMENT / HTTP 400); ``field`` names the offending field."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(field, message)


class Draining(Exception):
    """The server is shutting down: it takes no new requests (UNAVAILABLE / HTTP 503)."""


class DrafterBroken(Exception):
    """A drafter plugin failed to open a session for reasons of its own (INTERNAL / HTTP 500)."""


@dataclass
class GenSpec:
    """One generation as a front end asked for it (exactly one of ``prompt_text``/``prompt_ids``), already
    checked against ``protocols.request_limits`` by that front end; ``prompt_field`` is how it names the prompt."""

    prompt_text: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    max_new_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    budget: Optional[DraftBudget] = None
    stops: list[str] = field(default_factory=list)
    stop_ids: list[int] = field(default_factory=list)
    drafter: str = ""
    ignore_eos: bool = False
    request_id: str = ""
    prompt_field: str = "prompt"


@dataclass
class Job:
    spec: GenSpec
    prompt: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    drafter_name: str
    drafter: Optional[Drafter]


def choice_job(job: Job, index: int) -> Job:
    """Choice ``index`` of a request for several (OpenAI ``n``): with a seed ``s`` it draws as a request of seed
    ``s + index`` alone would (choice 0 is the request itself); without one, each choice gets a fresh seed anyway."""
    seed = job.spec.params.seed
    if seed is None:
        return job
    return replace(job, spec=replace(job.spec, params=replace(job.spec.params, seed=seed + index)))


@dataclass
class Event(StreamChunk):
    """One streamed step (tokens, text, step stats), or the last one: ``finished`` with totals. A request the
    server could not finish ends with ``finish_reason == "error"`` and ``error`` saying why (``retryable``:
    the request was fine, the server shut down under it)."""

    error: str = ""
    retryable: bool = False


class _RootOnly:
    """The drafter session of a request that asked for no drafting on a host-drafter engine."""

    def __init__(self, prompt: list[int]):
        self.root = prompt[-1]

    def draft(self, budget):
        return TokenTree.chain([self.root])

    def commit(self, tokens):
        self.root = tokens[-1]

    def close(self):
        return None


def longest_token_bytes(tokenizer) -> int:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry: no token covers more of a prompt (byte-level
    entries spell one input byte per character; a metaspace is longer than the space it stands for)."""
    if tokenizer is None:
        return 1
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab(with_added_tokens=True)),
               default=1)


class ServingCore:
    """The model, its tokenizer, the drafters, one Engine stepped by one Scheduler, and the metrics."""

    def __init__(self, model, tokenizer, drafters, limits: ServerLimits, metrics: ServerMetrics,
                 eos_id=None, cuda_graphs: Optional[bool] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.drafters = drafters
        self.limits = limits
        self.metrics = metrics
        # one EOS id or several (generation_config.json may list many)
        self.eos_ids = [] if eos_id is None else ([int(eos_id)] if isinstance(eos_id, int) else [int(e) for e in eos_id])
        self.max_prompt_bytes = limits.max_prompt_bytes or prompt_byte_limit(limits.max_seq_len,
                                                                             longest_token_bytes(tokenizer))
        # a JSON string escapes a byte in at most 6 characters; ids take at most 12 ("4294967295, ")
        self.max_body_bytes = limits.max_body_bytes or (6 * self.max_prompt_bytes + 12 * limits.max_seq_len
                                                        + (1 << 16))
        self.engine, self.device_drafter_name = self._engine(cuda_graphs)
        self.engine.warm_up()  # every step graph captured before the first request (CUDA only)
        reserved = limits.max_sessions // 8 if limits.reserved_slots is None else limits.reserved_slots
        self.scheduler = Scheduler(self.engine, limits.max_waiting, limits.max_streams_per_client, reserved)
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="stree-prepare")
        self._ids = itertools.count(1)
        self.draining = False
        self.open_generations = 0  # Generations whose event stream has not ended yet

    def _engine(self, cuda_graphs):
        """Plain, device-drafter or host-drafter engine, from the server's default drafter."""
        lim = self.limits
        kwargs = dict(max_batch=lim.max_sessions, max_seqlen=lim.max_seq_len, cuda_graphs=cuda_graphs,
                      budget=lim.budget, prefill_chunk=lim.prefill_chunk,
                      admit_hold_steps=lim.admit_hold_steps)
        if self.drafters.default == NO_DRAFTER:
            return Engine(self.model, None, ["none"], **kwargs), NO_DRAFTER
        if not isinstance(self.drafters, RemoteDrafters):
            offer = device_offer(self.drafters.get(""), lim.budget)
            if offer is not None:
                return (Engine(self.model, offer.drafter, offer.shapes, goodput=len(offer.shapes) > 1, **kwargs),
                        self.drafters.default)
        return Engine(self.model, "host", (), **kwargs), None

    # ----- checks ----------------------------------------------------------------------------
    def check(self, spec: GenSpec) -> Job:
        """Tokenize and check ``spec`` (blocking: call through ``prepare``)."""
        lim, where = self.limits, spec.prompt_field
        if (spec.prompt_text is None) == (spec.prompt_ids is None):
            raise InvalidRequest("the request has no prompt: set prompt_text or prompt_ids", where)
        vocab = self.model.vocab_size
        if spec.prompt_text is not None:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send prompt_ids instead of prompt_text", where)
            if len(spec.prompt_text) > lim.max_prompt_chars:
                raise InvalidRequest(f"the prompt has {len(spec.prompt_text)} characters, over the server's "
                                     f"limit of {lim.max_prompt_chars}", where)
            check_prompt_size(spec.prompt_text, self.max_prompt_bytes, where)
            prompt = self.tokenizer.encode_batch([spec.prompt_text])[0].ids  # releases the GIL; encode does not
        else:
            prompt = list(spec.prompt_ids)
        check_prompt_ids(prompt, vocab, where)
        max_new = spec.max_new_tokens or lim.default_max_new_tokens
        if max_new < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new}", "max_new_tokens")
        if max_new > lim.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens {max_new} is over the server's limit of {lim.max_new_tokens}",
                                 "max_new_tokens")
        if len(prompt) + max_new > lim.max_seq_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; with max_new_tokens {max_new} that is "
                                 f"over the server's limit of {lim.max_seq_len} tokens", where)
        if spec.stops and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
        stop_ids = check_stop_ids(spec.stop_ids, vocab)
        name = spec.drafter or self.drafters.default
        if self.device_drafter_name is not None and name not in (self.device_drafter_name, NO_DRAFTER):
            raise InvalidRequest(f"this server drafts with {self.device_drafter_name!r} on the device; "
                                 f"drafter {name!r} cannot be chosen per request", "drafter")
        drafter = None
        if self.device_drafter_name is None:
            try:
                drafter = self.drafters.get(spec.drafter)
            except ValueError as exc:
                raise InvalidRequest(str(exc), "drafter") from exc
        if not spec.ignore_eos:
            stop_ids += [e for e in self.eos_ids if e not in stop_ids]
        return Job(spec, prompt, max_new, stop_ids, name, drafter)

    def _open(self, job: Job):
        """The request's host drafter session (may block on a remote DrafterService)."""
        if not self.engine.host:
            return None
        if job.drafter is None:
            return _RootOnly(job.prompt)
        budget = job.spec.budget or self.limits.budget
        params = session_params(job.spec.params)
        try:
            if isinstance(job.drafter, RemoteDrafter):
                return job.drafter.open(job.prompt, params, budget=budget)
            return job.drafter.open(job.prompt, params)
        except ValueError as exc:
            raise InvalidRequest(f"drafter {job.drafter_name!r}: {exc}", "drafter") from exc
        except Exception:  # noqa: BLE001 - a plugin's own failure: logged here, a plain sentence for the client
            log.exception("drafter %s failed to open a session", log_field(job.drafter_name))
            raise DrafterBroken(f"drafter {job.drafter_name!r} failed to open a session "
                                f"(the server log has the details)") from None

    async def prepare(self, spec: GenSpec) -> Job:
        """``check`` on a worker thread (tokenizing a long prompt must not stall other streams)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.check, spec)

    # ----- generation ---------------------------------------------------------------------------
    def _refuse(self, client: str, count: int) -> None:
        if self.draining:
            raise Draining("the server is shutting down and takes no new requests; retry on another replica")
        refusal = self.scheduler.room_problem(client, count)
        if refusal is not None:
            raise refusal

    async def admit(self, jobs: list[Job], client: str = "") -> list["Generation"]:
        """Open each job's drafter session and submit all of them to the scheduler at once. Raises ``Draining``,
        ``QueueFull`` (``ClientLimit`` for this client's cap) or ``DrafterBroken`` before anything is streamed."""
        loop = asyncio.get_running_loop()
        sessions: list = []
        try:
            self._refuse(client, len(jobs))
            for job in jobs:
                sessions.append(await loop.run_in_executor(self.executor, self._open, job))
            self._refuse(client, len(jobs))
            gens = {}
            for job, session in zip(jobs, sessions):
                gen = Generation(self, job, session, client, loop)
                gens[id(gen.req)] = gen
            self.scheduler.submit([g.req for g in gens.values()], lambda req: gens[id(req)].on_finish())
        except BaseException as exc:
            for s in sessions:
                if s is not None:
                    s.close()
            if isinstance(exc, (QueueFull, Draining)):
                self.metrics.rejected.inc(len(jobs))
                log.info("refused %d request(s) of client %s: %s", len(jobs), log_field(client), exc)
            raise
        for g in gens.values():
            g.queued()
        self._gauges()
        return list(gens.values())

    async def stream(self, job: Job, client: str = "") -> AsyncIterator[Event]:
        """``admit`` one job and yield its events (raises ``QueueFull`` when the server is at its bound)."""
        (gen,) = await self.admit([job], client)
        async for ev in gen.events():
            yield ev

    def _gauges(self) -> None:
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.waiting.set(self.scheduler.num_waiting)

    def active_sessions(self) -> int:
        return self.scheduler.num_live

    # ----- shutdown ---------------------------------------------------------------------------------
    async def drain(self, timeout: float) -> int:
        """Stop admitting; let the requests in flight finish for up to ``timeout`` seconds, then end the rest
        with a retryable error (their streams get it as their last event). Returns how many were ended so."""
        self.draining = True
        end = time.monotonic() + max(0.0, timeout)
        while self.scheduler.num_live and time.monotonic() < end:
            await asyncio.sleep(0.05)
        ended = self.scheduler.end_all(f"the server shut down before this request finished (it waited "
                                       f"{timeout:g} s for requests in flight); retry it", retryable=True)
        flush = time.monotonic() + 10.0  # each ended stream sends its error event
        while (self.scheduler.num_live or self.open_generations) and time.monotonic() < flush:
            await asyncio.sleep(0.05)
        if ended:
            log.warning("drain: %d request(s) did not finish within %g s and were ended", ended, timeout)
        return ended

    def close(self) -> None:
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


class Generation:
    """One admitted request: its engine request, and its events as an async iterator (``events``)."""

    def __init__(self, core: ServingCore, job: Job, session, client: str, loop):
        self.core, self.job, self.loop = core, job, loop
        self.started = time.perf_counter()
        self.rid = job.spec.request_id or f"req-{next(core._ids)}"
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stopped_by_text = False
        self.req = ServedRequest(job.prompt, job.max_new_tokens, job.spec.params, frozenset(job.stop_ids),
                                 request_id=self.rid, drafter_session=session, on_tokens=self._on_tokens,
                                 client=client)

    def _on_tokens(self, req: Request, got: list[int]) -> None:  # on the scheduler thread
        snap = (list(got), req.steps, req.num_draft_tokens, req.num_accepted_draft_tokens,
                req.drafter_fallbacks, time.perf_counter())
        self.loop.call_soon_threadsafe(self.queue.put_nowait, snap)

    def queued(self) -> None:
        """Called once the scheduler took the request: the queued metrics and log line."""
        core = self.core
        core.metrics.prompt_tokens.inc(len(self.job.prompt))
        log.info("request_id=%s client=%s queued prompt_tokens=%d max_new_tokens=%d drafter=%s",
                 log_field(self.rid), log_field(self.req.client), len(self.job.prompt), self.job.max_new_tokens,
                 log_field(self.job.drafter_name))

    def on_finish(self) -> None:  # on the scheduler thread, once, after the request left the engine
        self.loop.call_soon_threadsafe(self._finished)

    def _finished(self) -> None:
        self.core.metrics.success(self.reason())
        self.queue.put_nowait(None)

    def reason(self) -> str:
        """The finish reason a client sees (and the metrics count): stop, length, abort or error."""
        if self.stopped_by_text:
            return "stop"
        reason = self.req.finish_reason or "error"
        return "abort" if reason == "cancelled" else reason

    def cancel(self) -> None:
        if not self.req.done:
            self.core.scheduler.cancel(self.req)

    async def events(self) -> AsyncIterator[Event]:
        core = self.core
        core.open_generations += 1
        try:
            async for ev in self._events():
                yield ev
        except Exception:
            log.exception("request_id=%s failed", log_field(self.rid))
            raise
        finally:
            core.open_generations -= 1
            if not self.req.done:
                core.scheduler.cancel(self.req)
                log.info("request_id=%s cancelled by the client", log_field(self.rid))
            core._gauges()

    async def _events(self):
        job, req, m = self.job, self.req, self.core.metrics
        text = TextStream(self.core.tokenizer, job.spec.stops)
        out: list[int] = []
        prev = (0, 0, 0, 0)
        started = self.started
        last_t, first_t = started, None
        while True:
            snap = await self.queue.get()
            if snap is None:
                break
            got, steps, drafted, accepted, fallbacks, t = snap
            if first_t is None:
                first_t = t
                m.ttft.observe(t - started)
                m.queue_time.observe(max(0.0, t - started - req.prefill_s))
                self.core._gauges()
            else:
                m.itl.observe((t - last_t) / len(got))
            d_steps, d_drafted, d_acc, d_fb = (steps - prev[0], drafted - prev[1], accepted - prev[2],
                                               fallbacks - prev[3])
            prev = (steps, drafted, accepted, fallbacks)
            self._count(d_drafted, d_acc, d_fb, got)
            step = {"step": steps, "draft_nodes": d_drafted // max(d_steps, 1) + 1, "accepted": d_acc,
                    "fallback": d_fb > 0, "step_seconds": t - last_t}
            last_t = t
            out.extend(got)
            delta = text.update(out, final=False)
            if text.stopped:
                keep = text.tokens_through_stop(out)
                got = got[: max(0, len(got) - (len(out) - len(keep)))]
                out = keep
                self.stopped_by_text = True
                self.core.scheduler.cancel(req)
                yield Event(got, delta, step)
                break
            yield Event(got, delta, step)
        total = time.perf_counter() - started
        reason = self.reason()
        tail = "" if text.stopped else text.update(out, final=True)
        ttft = (first_t - started) if first_t else total
        n = len(out)
        if n > 1:
            m.tpot.observe((last_t - first_t) / (n - 1))
        m.e2e.observe(total)
        m.accepted_at(req.accepted_per_pos)
        core = self.core
        stats = {
            "prompt_tokens": len(job.prompt), "generated_tokens": n, "steps": req.steps,
            "mean_accepted_length": n / req.steps if req.steps else 0.0,
            "draft_tokens": req.num_draft_tokens, "accepted_draft_tokens": req.num_accepted_draft_tokens,
            "fallbacks": req.drafter_fallbacks, "time_to_first_token_s": ttft, "total_s": total,
            "tokens_per_s": n / total if total > 0 else 0.0,
            "drafter": job.drafter_name if (job.drafter is not None or core.device_drafter_name) else NO_DRAFTER,
        }
        log.info("request_id=%s finished reason=%s generated_tokens=%d steps=%d accepted=%d total_s=%.3f",
                 log_field(self.rid), reason, n, req.steps, req.num_accepted_draft_tokens, total)
        error = ""
        if reason == "error":
            error = req.error_message or "this request failed in the engine (the server log has the details)"
        yield Event([], tail, {}, finished=True, finish_reason=reason, stats=stats, error=error,
                    retryable=req.retryable)

    def _count(self, drafted: int, accepted: int, fallbacks: int, emitted: list) -> None:
        m, core = self.core.metrics, self.core
        if drafted or self.job.drafter is not None or core.device_drafter_name:
            m.drafts.inc()
            m.drafted.inc(drafted)
            m.accepted.inc(accepted)
        if fallbacks:
            m.fallbacks.inc(fallbacks)
        m.generation_tokens.inc(len(emitted))
        if emitted:
            m.accept_len.observe(len(emitted))
