"""The OpenAI-compatible HTTP API (Starlette) on the shared serving core.

``/v1/completions``, ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``, ``/health``,
``/metrics``. Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, with no
class names or paths in them. ``usage`` carries the request's speculative stats (``drafted``, ``accepted``,
``mean_accepted_length``).

A body is read up to the server's byte cap (413 past it) within ``body_timeout_s`` (408 after it), before
anything is parsed. Every choice of a request is admitted before the response starts, so a full queue,
the client's cap (both 429) or a draining server (503) is a status code, never bytes inside a stream. A
stream the server cannot finish ends with an error event, then ``[DONE]``. ``/health`` answers 503
(``draining``) once shutdown began.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stree.protocols.request_limits import FieldError, shorten
from stree.verifier.service.chat_template import ChatTemplate, ChatTemplateError
from stree.verifier.service.core import DrafterBroken, Draining, GenSpec, ServingCore, choice_job
from stree.verifier.service.openai_schema import ApiRequest, parse
from stree.verifier.service.scheduler import QueueFull

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}


def error(status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class HttpRefusal(Exception):
    """A request refused with ``status`` before its body was parsed (too large, too slow)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Stream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends, even when the client left before its first byte
    (the body iterator then never starts, and its own cleanup would never run)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class OpenAIApp:
    """Builds the Starlette app for one served model id."""

    def __init__(self, core: ServingCore, model_id: str, chat_template: ChatTemplate,
                 api_key: Optional[str] = None):
        self.core = core
        self.model_id = model_id
        self.template = chat_template
        self.api_key = api_key
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._internal})

    async def _not_found(self, request, exc):
        return error(404, f"no route {shorten(request.url.path)}")

    async def _not_allowed(self, request, exc):
        return error(405, f"{shorten(request.method)} is not allowed on {shorten(request.url.path)}")

    async def _internal(self, request, exc):
        log.error("internal error on %s", request.url.path, exc_info=exc)
        return error(500, "internal error (the server log has the details)")

    def _unauthorized(self, request: Request) -> Optional[JSONResponse]:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return error(401, "a valid API key is required: 'Authorization: Bearer KEY'")
        return None

    # ----- plain routes ------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.core.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "stree",
             "max_model_len": self.core.limits.max_seq_len}]})

    # ----- generation routes -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes``, arrived within ``body_timeout_s``."""
        cap, timeout = self.core.max_body_bytes, self.core.limits.body_timeout_s
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and (len(declared) > 18 or int(declared) > cap):
            raise HttpRefusal(413, f"the request body has {declared} bytes, over the server's limit of {cap}")
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise HttpRefusal(413, f"the request body is over the server's limit of {cap} bytes")
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise HttpRefusal(408, f"the request body did not arrive within {timeout:g} s") from None
        return b"".join(chunks)

    async def _generate(self, request: Request, chat: bool) -> Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        try:
            raw = await self._body(request)
        except HttpRefusal as exc:  # and close the connection: the server would otherwise read the rest
            return error(exc.status, str(exc), headers={"connection": "close"})
        try:
            body = json.loads(raw)
        except RecursionError:
            return error(400, "the body is not valid JSON: it is nested too deeply")
        except ValueError as exc:
            return error(400, f"the body is not valid JSON: {exc}")
        client = request.client.host if request.client else "?"
        try:
            api = parse(body, chat, {self.model_id}, self.core.limits)
            gens = await self.core.admit(await self._jobs(api), client)
        except FieldError as exc:
            return error(400, str(exc), exc.field)
        except ChatTemplateError as exc:
            return error(400, str(exc), "messages")
        except QueueFull as exc:
            return error(429, str(exc))
        except Draining as exc:
            return error(503, str(exc))
        except DrafterBroken as exc:
            return error(500, str(exc))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if api.stream:
            return _Stream(self._sse(api, gens, rid, chat), on_close=lambda: [g.cancel() for g in gens])
        try:
            results = await self._run_unary(request, gens)
        finally:
            for g in gens:
                g.cancel()
        if results is None:  # the client went away
            return Response(status_code=499)
        failed = next((r for r in results if r["finish_reason"] == "error"), None)
        if failed is not None:
            return error(503 if failed["retryable"] else 500, failed["error"])
        return JSONResponse(self._unary_body(api, results, rid, chat))

    async def _jobs(self, api: ApiRequest) -> list:
        if api.messages is not None:
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(self.core.executor, self.template.render, api.messages,
                                              api.add_generation_prompt)
            field = "messages"
        else:
            text, field = api.prompt_text, "prompt"
        spec = GenSpec(prompt_text=text, prompt_ids=api.prompt_ids, max_new_tokens=api.max_tokens,
                       params=api.params, stops=api.stops, stop_ids=api.stop_ids, drafter=api.drafter,
                       ignore_eos=api.ignore_eos, prompt_field=field)
        job = await self.core.prepare(spec)
        return [job] + [choice_job(job, i) for i in range(1, api.n)]

    @staticmethod
    async def _collect(gen) -> dict:
        ids, text, last = [], [], None
        async for ev in gen.events():
            ids += ev.token_ids
            text.append(ev.text)
            last = ev
        return {"token_ids": ids, "text": "".join(text), "finish_reason": last.finish_reason, "stats": last.stats,
                "error": last.error, "retryable": last.retryable}

    async def _run_unary(self, request: Request, gens: list) -> Optional[list]:
        """All choices; None (everything cancelled) when the client disconnects first."""
        tasks = [asyncio.ensure_future(self._collect(g)) for g in gens]
        gathered = asyncio.gather(*tasks)
        try:
            while True:
                done, _ = await asyncio.wait([gathered], timeout=0.25)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    return None
        finally:
            for t in tasks:
                t.cancel()
            if not gathered.done():
                gathered.cancel()
            await asyncio.gather(gathered, return_exceptions=True)

    # ----- response bodies ---------------------------------------------------------------------
    @staticmethod
    def _usage(stats_list: list[dict]) -> dict:
        prompt = stats_list[0]["prompt_tokens"] if stats_list else 0
        completion = sum(s["generated_tokens"] for s in stats_list)
        drafted = sum(s["draft_tokens"] for s in stats_list)
        accepted = sum(s["accepted_draft_tokens"] for s in stats_list)
        steps = sum(s["steps"] for s in stats_list)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "speculative": {"drafted": drafted, "accepted": accepted,
                                "mean_accepted_length": completion / steps if steps else 0.0}}

    @staticmethod
    def _finish(reason: str) -> str:
        return reason if reason in ("stop", "length") else "abort"

    def _unary_body(self, api: ApiRequest, results: list[dict], rid: str, chat: bool) -> dict:
        choices = []
        for i, r in enumerate(results):
            choice = {"index": i, "finish_reason": self._finish(r["finish_reason"]), "logprobs": None,
                      "token_ids": r["token_ids"]}
            if chat:
                choice["message"] = {"role": "assistant", "content": r["text"]}
            else:
                choice["text"] = r["text"]
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id, "choices": choices,
                "usage": self._usage([r["stats"] for r in results])}

    def _chunk(self, rid: str, chat: bool, index: int, text: str, ids: list[int], finish: Optional[str],
               first: bool) -> str:
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        choice["token_ids"] = ids
        body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    async def _sse(self, api: ApiRequest, gens: list, rid: str, chat: bool):
        """One SSE stream for all ``n`` choices; leaving early (disconnect) cancels every one. A choice the server
        cannot finish sends an error event (OpenAI's error shape) in place of its last chunk."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen) -> None:
            try:
                async for ev in gen.events():
                    await merged.put((index, ev))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            async for event in self._sse_events(api, merged, len(gens), rid, chat):
                yield event
        except Exception:  # noqa: BLE001 - a bug of ours: the log has it, the client an error event
            log.exception("%s failed while streaming", rid)
            yield f"data: {json.dumps(error_body(500, 'internal error while generating (the server log has it)'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sse_events(self, api: ApiRequest, merged: asyncio.Queue, open_: int, rid: str, chat: bool):
        """The SSE lines of ``open_`` choices whose events arrive on ``merged`` (``None``: that choice ended)."""
        stats, first = [], set()
        while open_:
            index, ev = await merged.get()
            if ev is None:
                open_ -= 1
                continue
            if ev.finished and ev.finish_reason == "error":
                yield f"data: {json.dumps(error_body(503 if ev.retryable else 500, ev.error))}\n\n"
                continue
            finish = self._finish(ev.finish_reason) if ev.finished else None
            if ev.finished:
                stats.append(ev.stats)
            if ev.text or ev.token_ids or finish or index not in first:
                yield self._chunk(rid, chat, index, ev.text, ev.token_ids, finish, index not in first)
                first.add(index)
        if api.include_usage:
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()), "model": self.model_id, "choices": [],
                    "usage": self._usage(stats)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
