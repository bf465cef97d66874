"""The verifier's GenerationService (grpc.aio) on the shared continuous-batching core.

Every request joins one Engine stepped by one scheduler thread (``core.py``); a call streams one
chunk per step that emitted tokens. Cancelling the call frees its slot at the next step boundary.
Requests are checked against ``protocols.request_limits`` (the same bounds as the HTTP API): a bad one is
INVALID_ARGUMENT naming its field. Past the queue bound or the client's cap a call gets RESOURCE_EXHAUSTED,
while draining UNAVAILABLE; a request the engine fails ends INTERNAL (UNAVAILABLE when the server shut down
under it). With an API key every method but the health probes (reflection too) needs it. Optional TLS
(for HTTP too); the metrics port answers ``/metrics`` only; ``http_port`` adds the OpenAI-compatible HTTP
API on the same engine.
"""

from __future__ import annotations

import logging
from typing import Optional

import grpc
from google.protobuf.message import DecodeError

from stree.proto.codec import budget_from_pb
from stree.proto.rpc import (
    SERVER_OPTIONS,
    ApiKeyInterceptor,
    add_health_and_reflection,
    exposure_warnings,
    peer_host,
    set_serving,
)
from stree.proto.stree.v1 import generation_pb2, generation_pb2_grpc
from stree.protocols.request_limits import (
    FieldError,
    check_drafter_name,
    check_request_id,
    check_sampling,
    check_stops,
    log_field,
)
from stree.verifier.service.chat_template import ChatTemplate
from stree.verifier.service.core import (
    DrafterBroken,
    Draining,
    GenSpec,
    InvalidRequest,
    ServerLimits,
    ServingCore,
)
from stree.verifier.service.drafters import NO_DRAFTER, EmbeddedDrafters, RemoteDrafters
from stree.verifier.service.metrics import ServerMetrics
from stree.verifier.service.http_server import HttpServer
from stree.verifier.service.metrics_http import MetricsServer
from stree.verifier.service.openai_api import OpenAIApp
from stree.verifier.service.scheduler import QueueFull

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name

__all__ = ["EmbeddedDrafters", "GenerationServer", "GenerationServicer", "InvalidRequest", "NO_DRAFTER",
           "RemoteDrafters", "ServerLimits", "ServerMetrics", "grpc_options"]


def grpc_options(core: ServingCore) -> list:
    """Message size limits sized to the longest allowed prompt (text or ids) plus headroom."""
    size = max(core.max_prompt_bytes, core.limits.max_seq_len * 10) + (1 << 20)
    sized = {"grpc.max_receive_message_length", "grpc.max_send_message_length"}
    return [o for o in SERVER_OPTIONS if o[0] not in sized] + [(k, size) for k in sorted(sized)]


def _client_of(context) -> str:
    """The caller's address (``ipv4:127.0.0.1:5555`` -> ``127.0.0.1``), the key of per-client limits."""
    return peer_host(context.peer() or "").partition(":")[2].strip("[]")


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, core: ServingCore):
        self.core = core

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register both methods taking raw bytes, so a malformed request is ours to answer (INVALID_ARGUMENT)."""
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate, request_deserializer=None,
                response_serializer=generation_pb2.GenerateChunk.SerializeToString),
            "GenerateUnary": grpc.unary_unary_rpc_method_handler(
                self.GenerateUnary, request_deserializer=None,
                response_serializer=generation_pb2.GenerateResponse.SerializeToString),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))

    @staticmethod
    def _parse(req) -> generation_pb2.GenerateRequest:
        """The request as a message (raw bytes off the wire, or a message already); InvalidRequest when malformed."""
        if isinstance(req, generation_pb2.GenerateRequest):
            return req
        try:
            return generation_pb2.GenerateRequest.FromString(req)
        except DecodeError:
            raise InvalidRequest("request is not a valid stree.v1.GenerateRequest "
                                 "(malformed protobuf or invalid UTF-8)") from None

    def _spec(self, req) -> GenSpec:
        """The request checked against ``protocols.request_limits`` (the bounds the HTTP API checks too)."""
        kind = req.WhichOneof("prompt")
        sampling = req.sampling
        spec = GenSpec(max_new_tokens=req.max_new_tokens, stops=check_stops(list(req.stop), "stop"),
                       stop_ids=list(req.stop_token_ids), drafter=check_drafter_name(req.drafter),
                       ignore_eos=req.ignore_eos, request_id=check_request_id(req.request_id),
                       params=check_sampling(sampling.temperature, sampling.top_k,
                                             sampling.top_p if sampling.HasField("top_p") else 1.0,
                                             sampling.seed if sampling.HasField("seed") else None,
                                             prefix="sampling."))
        if kind == "prompt_text":
            spec.prompt_text, spec.prompt_field = req.prompt_text, "prompt_text"
        elif kind == "prompt_ids":
            spec.prompt_ids, spec.prompt_field = list(req.prompt_ids.ids), "prompt_ids"
        if req.HasField("budget"):
            try:
                spec.budget = budget_from_pb(req.budget, self.core.limits.budget)
            except ValueError as exc:
                raise InvalidRequest(f"bad draft budget: {exc}", "budget") from exc
        return spec

    async def _admit(self, req, context):
        """The request's one Generation, or ``(status, message)`` when it is refused before any chunk."""
        try:
            job = await self.core.prepare(self._spec(self._parse(req)))
            (gen,) = await self.core.admit([job], _client_of(context))
            return gen
        except FieldError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except QueueFull as exc:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except Draining as exc:
            return grpc.StatusCode.UNAVAILABLE, str(exc)
        except DrafterBroken as exc:
            return grpc.StatusCode.INTERNAL, str(exc)
        except Exception:  # noqa: BLE001 - a bug of ours: the log has it, the client a plain sentence
            log.exception("request refused by an internal error")
            return grpc.StatusCode.INTERNAL, "internal error while checking the request (the server log has it)"

    async def _run(self, req, context):
        gen = await self._admit(req, context)
        if isinstance(gen, tuple):
            await context.abort(*gen)
        failure = None
        events = gen.events()
        try:
            async for ev in events:
                step = generation_pb2.StepStats(**ev.step) if ev.step else None
                if ev.finished and ev.finish_reason == "error":
                    code = grpc.StatusCode.UNAVAILABLE if ev.retryable else grpc.StatusCode.INTERNAL
                    failure = (code, ev.error)
                elif ev.finished:
                    yield generation_pb2.GenerateChunk(text=ev.text, finished=True, finish_reason=ev.finish_reason,
                                                       stats=generation_pb2.GenerationStats(**ev.stats))
                else:
                    yield generation_pb2.GenerateChunk(token_ids=ev.token_ids, text=ev.text, step=step)
        except Exception:  # noqa: BLE001 - a bug of ours: the log has it, the client a plain sentence
            log.exception("request_id=%s failed while streaming", log_field(gen.rid))
            failure = (grpc.StatusCode.INTERNAL, "internal error while generating (the server log has it)")
        finally:
            await events.aclose()
        if failure is not None:
            await context.abort(*failure)

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
    """The GenerationService on ``bind:port`` (0: a free port), plus health, reflection and metrics.

    ``tls``: ``(cert_chain_pem, private_key_pem)`` bytes to serve gRPC and HTTP over TLS instead of plaintext.
    ``api_key``: required on every gRPC call but health probes (reflection included) and on HTTP's ``/v1``.
    ``drain_timeout``: seconds ``stop`` lets requests in flight finish before it ends them.
    """

    def __init__(self, model, tokenizer=None, drafters=None, port: int = 0, bind: str = "127.0.0.1",
                 limits: ServerLimits = ServerLimits(), model_name: str = "stree", eos_id=None,
                 metrics_port: Optional[int] = None, tls: Optional[tuple[bytes, bytes]] = None,
                 cuda_graphs: Optional[bool] = None, core: Optional[ServingCore] = None,
                 http_port: Optional[int] = None, model_dir: Optional[str] = None, api_key: Optional[str] = None,
                 drain_timeout: float = 0.0):
        self.drafters = drafters or EmbeddedDrafters(NO_DRAFTER)
        self.metrics = ServerMetrics(model_name) if core is None else core.metrics
        self.core = core or ServingCore(model, tokenizer, self.drafters, limits, self.metrics, eos_id, cuda_graphs)
        self.servicer = GenerationServicer(self.core)
        self.requested_port = port
        self.bind = bind
        self.tls = tls
        self.metrics_port = metrics_port
        self.server: Optional[grpc.aio.Server] = None
        self.health = None
        self.port: Optional[int] = None
        self._metrics_http: Optional[MetricsServer] = None
        self.model_name = model_name
        self.http_port, self.model_dir, self.api_key = http_port, model_dir, api_key
        self.drain_timeout = drain_timeout
        self.http: Optional[HttpServer] = None

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    def active_sessions(self) -> int:
        return self.core.active_sessions()

    async def start(self) -> None:
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        self.server = grpc.aio.server(options=grpc_options(self.core), interceptors=interceptors)
        self.servicer.add_to(self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        await set_serving(self.health, [SERVICE_NAME], serving=False)
        where = f"{self.bind}:{self.requested_port}"
        if self.tls is not None:
            creds = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])
            self.port = self.server.add_secure_port(where, creds)
        else:
            self.port = self.server.add_insecure_port(where)
        if not self.port:
            raise ValueError(f"cannot listen on {where}")
        await self.server.start()
        if self.metrics_port is not None:
            self._metrics_http = MetricsServer(self.bind, self.metrics_port, self.metrics.registry)
        if self.http_port is not None:
            app = OpenAIApp(self.core, self.model_name, ChatTemplate.from_model_dir(self.model_dir), self.api_key)
            self.http = HttpServer(app.app, self.bind, self.http_port, tls=self.tls)
            await self.http.start()
            log.info("OpenAI-compatible HTTP API on %s://%s/v1 (model %r)", "https" if self.tls else "http",
                     self.http.address, self.model_name)
        for warning in exposure_warnings(self.bind, bool(self.api_key), self.tls is not None):
            log.warning("%s", warning)
        await set_serving(self.health, [SERVICE_NAME])
        log.info("GenerationService on %s (%s), drafters: %s", self.address, "TLS" if self.tls else "plaintext",
                 self.drafters.describe())

    @property
    def metrics_address(self) -> Optional[str]:
        return None if self._metrics_http is None else self._metrics_http.address

    async def drain(self, timeout: float) -> int:
        """Report NOT_SERVING, refuse new requests (UNAVAILABLE / HTTP 503), let those in flight finish for up to
        ``timeout`` seconds, then end the rest with an error; returns how many were ended so."""
        if self.health is not None:
            await set_serving(self.health, [SERVICE_NAME], serving=False)
        return await self.core.drain(timeout)

    async def stop(self, grace: Optional[float] = 1.0) -> None:
        await self.drain(self.drain_timeout)
        if self.http is not None:
            await self.http.stop()
            self.http = None
        if self.server is not None:
            await self.server.stop(grace)
        if self._metrics_http is not None:
            self._metrics_http.close()
            self._metrics_http = None
        self.core.close()
        await self.drafters.aclose()

    async def wait(self) -> None:
        await self.server.wait_for_termination()
