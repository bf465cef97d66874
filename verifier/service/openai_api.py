"""The OpenAI-compatible HTTP API (Starlette) on the shared serving core.

``/v1/completions``, ``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``, ``/health``,
``/metrics``. Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
``usage`` carries the request's speculative stats (``drafted``, ``accepted``, ``mean_accepted_length``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time
import uuid
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stree.verifier.service.chat_template import ChatTemplate, ChatTemplateError
from stree.verifier.service.core import GenSpec, InvalidRequest, ServingCore
from stree.verifier.service.openai_schema import ApiRequest, BadField, parse
from stree.verifier.service.scheduler import QueueFull

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               429: "RateLimitError", 500: "InternalServerError"}


def error(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status)


class OpenAIApp:
    """Builds the Starlette app for one served model id."""

    def __init__(self, core: ServingCore, model_id: str, chat_template: ChatTemplate,
                 api_key: Optional[str] = None):
        self.core = core
        self.model_id = model_id
        self.template = chat_template
        self.api_key = api_key
        self.created = int(time.time())
        self.streams_per_client: collections.Counter = collections.Counter()
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request, exc):
        return error(404, f"no route {request.url.path}")

    async def _not_allowed(self, request, exc):
        return error(405, f"{request.method} is not allowed on {request.url.path}")

    def _unauthorized(self, request: Request) -> Optional[JSONResponse]:
        if self.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return error(401, "a valid API key is required: 'Authorization: Bearer KEY'")
        return None

    # ----- plain routes ------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
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

    async def _generate(self, request: Request, chat: bool) -> Response:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        try:
            body = json.loads(await request.body())
        except RecursionError:
            return error(400, "the body is not valid JSON: it is nested too deeply")
        except ValueError as exc:
            return error(400, f"the body is not valid JSON: {exc}")
        try:
            api = parse(body, chat, {self.model_id}, self.core.limits)
            jobs = await self._jobs(api)
        except BadField as exc:
            return error(400, str(exc), exc.param)
        except (InvalidRequest, ChatTemplateError) as exc:
            return error(400, str(exc), "messages" if isinstance(exc, ChatTemplateError) else None)
        client = request.client.host if request.client else "?"
        limit = self.core.limits.max_streams_per_client
        if self.streams_per_client[client] + len(jobs) > limit:
            return error(429, f"this client already has {self.streams_per_client[client]} generations "
                              f"running; the limit is {limit}")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if api.stream:
            return StreamingResponse(self._sse(api, jobs, rid, chat, client), media_type="text/event-stream")
        self.streams_per_client[client] += len(jobs)
        try:
            results = await self._run_unary(request, jobs)
        except QueueFull as exc:
            return error(429, str(exc))
        finally:
            self._leave(client, len(jobs))
        if results is None:  # the client went away
            return Response(status_code=499)
        return JSONResponse(self._unary_body(api, results, rid, chat))

    async def _jobs(self, api: ApiRequest) -> list:
        if api.messages is not None:
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(self.core.executor, self.template.render, api.messages,
                                              api.add_generation_prompt)
        else:
            text = api.prompt_text
        spec = GenSpec(prompt_text=text, prompt_ids=api.prompt_ids, max_new_tokens=api.max_tokens,
                       params=api.params, stops=api.stops, stop_ids=api.stop_ids, drafter=api.drafter,
                       ignore_eos=api.ignore_eos)
        job = await self.core.prepare(spec)
        return [job] * api.n

    def _leave(self, client: str, k: int) -> None:
        self.streams_per_client[client] -= k
        if self.streams_per_client[client] <= 0:
            del self.streams_per_client[client]

    async def _collect(self, job) -> dict:
        ids, text, last = [], [], None
        async for ev in self.core.stream(job):
            ids += ev.token_ids
            text.append(ev.text)
            last = ev
        return {"token_ids": ids, "text": "".join(text), "finish_reason": last.finish_reason, "stats": last.stats}

    async def _run_unary(self, request: Request, jobs: list) -> Optional[list]:
        """All choices; None (everything cancelled) when the client disconnects first."""
        tasks = [asyncio.ensure_future(self._collect(j)) for j in jobs]
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

    async def _sse(self, api: ApiRequest, jobs: list, rid: str, chat: bool, client: str):
        """One SSE stream for all ``n`` choices; leaving early (disconnect) cancels every one."""
        self.streams_per_client[client] += len(jobs)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job) -> None:
            try:
                async for ev in self.core.stream(job):
                    await merged.put((index, ev))
            except QueueFull as exc:
                await merged.put((index, exc))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, j)) for i, j in enumerate(jobs)]
        stats, first, open_ = [], set(), len(jobs)
        try:
            while open_:
                index, ev = await merged.get()
                if ev is None:
                    open_ -= 1
                    continue
                if isinstance(ev, QueueFull):
                    err = {"error": {"message": str(ev), "type": "RateLimitError", "param": None, "code": 429}}
                    yield f"data: {json.dumps(err)}\n\n"
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
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._leave(client, len(jobs))
