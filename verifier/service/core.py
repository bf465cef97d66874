"""What both front ends share: request checks, the one Engine + Scheduler, and a request's event stream.

``ServingCore.prepare`` checks and tokenizes a ``GenSpec`` (on a worker thread, off the event loop),
``ServingCore.stream`` submits it to the scheduler and yields ``Event``s (tokens, text, step stats),
the last one finished with totals. Leaving the iterator early cancels the request, which frees its
slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget, Drafter
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS, Engine, Request
from stree.verifier.decode.loop import device_offer
from stree.verifier.service.client import StreamChunk as Event  # one streamed step, or the totals
from stree.verifier.service.drafters import NO_DRAFTER, RemoteDrafters
from stree.verifier.service.metrics import ServerMetrics
from stree.verifier.service.remote_drafter import RemoteDrafter
from stree.verifier.service.scheduler import QueueFull, Scheduler
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
    max_streams_per_client: int = 16
    prefill_chunk: int = 512
    admit_hold_steps: int = ADMIT_HOLD_STEPS  # steps free slots may wait to batch queued prompts' prefills
    budget: DraftBudget = field(default_factory=lambda: DEFAULT_BUDGET)


class InvalidRequest(ValueError):
    """A request the server refuses (INVALID_ARGUMENT / HTTP 400)."""


@dataclass
class GenSpec:
    """One generation as a front end asked for it (exactly one of ``prompt_text``/``prompt_ids``)."""

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


@dataclass
class Job:
    spec: GenSpec
    prompt: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    drafter_name: str
    drafter: Optional[Drafter]


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
        self.engine, self.device_drafter_name = self._engine(cuda_graphs)
        self.engine.warm_up()  # every step graph captured before the first request (CUDA only)
        self.scheduler = Scheduler(self.engine, limits.max_waiting)
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="stree-prepare")
        self._ids = itertools.count(1)

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
        lim = self.limits
        if (spec.prompt_text is None) == (spec.prompt_ids is None):
            raise InvalidRequest("the request has no prompt: set prompt_text or prompt_ids")
        if spec.prompt_text is not None:
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send prompt_ids instead of prompt_text")
            if len(spec.prompt_text) > lim.max_prompt_chars:
                raise InvalidRequest(f"the prompt has {len(spec.prompt_text)} characters, over the server's "
                                     f"limit of {lim.max_prompt_chars}")
            prompt = self.tokenizer.encode(spec.prompt_text).ids
        else:
            prompt = list(spec.prompt_ids)
        if not prompt:
            raise InvalidRequest("the prompt is empty (it must have at least one token)")
        vocab = self.model.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise InvalidRequest(f"prompt token id {max(prompt)} is outside the vocabulary of {vocab}")
        max_new = spec.max_new_tokens or lim.default_max_new_tokens
        if max_new < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new}")
        if max_new > lim.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens {max_new} is over the server's limit of {lim.max_new_tokens}")
        if len(prompt) + max_new > lim.max_seq_len:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; with max_new_tokens {max_new} that is "
                                 f"over the server's limit of {lim.max_seq_len} tokens")
        if spec.stops and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if any(t >= vocab or t < 0 for t in spec.stop_ids):
            raise InvalidRequest(f"a stop token id is outside the vocabulary of {vocab}")
        name = spec.drafter or self.drafters.default
        if self.device_drafter_name is not None and name not in (self.device_drafter_name, NO_DRAFTER):
            raise InvalidRequest(f"this server drafts with {self.device_drafter_name!r} on the device; "
                                 f"drafter {name!r} cannot be chosen per request")
        drafter = None
        if self.device_drafter_name is None:
            try:
                drafter = self.drafters.get(spec.drafter)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from exc
        stop_ids = list(spec.stop_ids)
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
        try:
            if isinstance(job.drafter, RemoteDrafter):
                return job.drafter.open(job.prompt, job.spec.params, budget=budget)
            return job.drafter.open(job.prompt, job.spec.params)
        except ValueError as exc:
            raise InvalidRequest(f"drafter {job.drafter_name!r}: {exc}") from exc

    async def prepare(self, spec: GenSpec) -> Job:
        """``check`` on a worker thread (tokenizing a long prompt must not stall other streams)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.check, spec)

    # ----- generation ---------------------------------------------------------------------------
    async def stream(self, job: Job) -> AsyncIterator[Event]:
        """Run ``job`` in the batch; raises ``QueueFull`` when the server is at its bound."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        rid = job.spec.request_id or f"req-{next(self._ids)}"
        session = await loop.run_in_executor(self.executor, self._open, job)
        events: asyncio.Queue = asyncio.Queue()

        def on_tokens(req: Request, got: list[int]) -> None:
            snap = (list(got), req.steps, req.num_draft_tokens, req.num_accepted_draft_tokens,
                    req.drafter_fallbacks, time.perf_counter())
            loop.call_soon_threadsafe(events.put_nowait, snap)

        def on_finish(req: Request) -> None:
            loop.call_soon_threadsafe(events.put_nowait, None)

        req = Request(job.prompt, job.max_new_tokens, job.spec.params, frozenset(job.stop_ids), request_id=rid,
                      drafter_session=session, on_tokens=on_tokens)
        try:
            self.scheduler.submit(req, on_finish)
        except QueueFull:
            if session is not None:
                session.close()
            self.metrics.rejected.inc()
            log.info("request_id=%s rejected: queue full", rid)
            raise
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self._gauges()
        log.info("request_id=%s queued prompt_tokens=%d max_new_tokens=%d drafter=%s", rid, len(job.prompt),
                 job.max_new_tokens, job.drafter_name)
        try:
            async for ev in self._events(job, req, events, started):
                yield ev
        except Exception:
            log.exception("request_id=%s failed", rid)
            raise
        finally:
            if not req.done:
                self.scheduler.cancel(req)
                log.info("request_id=%s cancelled by the client", rid)
            self._gauges()

    async def _events(self, job: Job, req: Request, events: asyncio.Queue, started: float):
        m = self.metrics
        text = TextStream(self.tokenizer, job.spec.stops)
        out: list[int] = []
        prev = (0, 0, 0, 0)
        last_t, first_t, reason = started, None, None
        while True:
            snap = await events.get()
            if snap is None:
                break
            got, steps, drafted, accepted, fallbacks, t = snap
            if first_t is None:
                first_t = t
                m.ttft.observe(t - started)
                m.queue_time.observe(max(0.0, t - started - req.prefill_s))
                self._gauges()
            else:
                m.itl.observe((t - last_t) / len(got))
            d_steps, d_drafted, d_acc, d_fb = (steps - prev[0], drafted - prev[1], accepted - prev[2],
                                               fallbacks - prev[3])
            prev = (steps, drafted, accepted, fallbacks)
            self._count(job, d_drafted, d_acc, d_fb, got)
            step = {"step": steps, "draft_nodes": d_drafted // max(d_steps, 1) + 1, "accepted": d_acc,
                    "fallback": d_fb > 0, "step_seconds": t - last_t}
            last_t = t
            out.extend(got)
            delta = text.update(out, final=False)
            if text.stopped:
                keep = text.tokens_through_stop(out)
                got = got[: max(0, len(got) - (len(out) - len(keep)))]
                out = keep
                reason = "stop"
                self.scheduler.cancel(req)
                yield Event(got, delta, step)
                break
            yield Event(got, delta, step)
        total = time.perf_counter() - started
        reason = reason or req.finish_reason or "error"
        if reason == "cancelled":
            reason = "abort"
        tail = "" if text.stopped else text.update(out, final=True)
        ttft = (first_t - started) if first_t else total
        n = len(out)
        if n > 1:
            m.tpot.observe((last_t - first_t) / (n - 1))
        m.e2e.observe(total)
        m.success(reason)
        m.accepted_at(req.accepted_per_pos)
        stats = {
            "prompt_tokens": len(job.prompt), "generated_tokens": n, "steps": req.steps,
            "mean_accepted_length": n / req.steps if req.steps else 0.0,
            "draft_tokens": req.num_draft_tokens, "accepted_draft_tokens": req.num_accepted_draft_tokens,
            "fallbacks": req.drafter_fallbacks, "time_to_first_token_s": ttft, "total_s": total,
            "tokens_per_s": n / total if total > 0 else 0.0,
            "drafter": job.drafter_name if (job.drafter is not None or self.device_drafter_name) else NO_DRAFTER,
        }
        log.info("request_id=%s finished reason=%s generated_tokens=%d steps=%d accepted=%d total_s=%.3f",
                 req.request_id, reason, n, req.steps, req.num_accepted_draft_tokens, total)
        yield Event([], tail, {}, finished=True, finish_reason=reason, stats=stats)

    def _count(self, job: Job, drafted: int, accepted: int, fallbacks: int, emitted: list) -> None:
        m = self.metrics
        if drafted or job.drafter is not None or self.device_drafter_name:
            m.drafts.inc()
            m.drafted.inc(drafted)
            m.accepted.inc(accepted)
        if fallbacks:
            m.fallbacks.inc(fallbacks)
        m.generation_tokens.inc(len(emitted))
        if emitted:
            m.accept_len.observe(len(emitted))

    def _gauges(self) -> None:
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.waiting.set(self.scheduler.num_waiting)

    def active_sessions(self) -> int:
        return self.scheduler.num_live

    def close(self) -> None:
        self.scheduler.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
