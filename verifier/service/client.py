"""``stree.Client``: a small synchronous client of the verifier's GenerationService.

``generate`` returns the whole result; ``stream`` yields one chunk per decoding step (closing the
iterator early cancels the call, which frees the session on the server). A request the server
refuses as INVALID_ARGUMENT raises ``ValueError`` with the server's message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stree.proto.rpc import CHANNEL_OPTIONS
from stree.proto.stree.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from stree.protocols.drafter import DraftBudget


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict = field(default_factory=dict)


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    step: dict
    finished: bool = False
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)


def _stats_dict(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _raise_from(exc: grpc.RpcError):
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(exc.details()) from None
    raise exc


class Client:
    """Talks to a ``stree serve`` at ``address`` (``HOST:PORT``)."""

    def __init__(self, address: str, timeout: Optional[float] = None):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    # ----- requests ------------------------------------------------------------------------------
    @staticmethod
    def request(
        prompt: Optional[str] = None,
        prompt_ids: Optional[Sequence[int]] = None,
        max_new_tokens: int = 0,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: Optional[int] = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        drafter: str = "",
        budget: Optional[DraftBudget] = None,
        ignore_eos: bool = False,
    ) -> generation_pb2.GenerateRequest:
        """The GenerateRequest for these arguments (exactly one of ``prompt``/``prompt_ids``)."""
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("pass exactly one of prompt= (text) or prompt_ids= (token ids)")
        sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if seed is not None:
            sampling.seed = seed
        req = generation_pb2.GenerateRequest(
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop=list(stop),
            stop_token_ids=[int(t) for t in stop_token_ids],
            drafter=drafter,
            ignore_eos=ignore_eos,
        )
        if prompt is not None:
            req.prompt_text = prompt
        else:
            if any(int(t) < 0 for t in prompt_ids):
                raise ValueError("prompt_ids must be non-negative token ids")
            req.prompt_ids.ids.extend(int(t) for t in prompt_ids)
        if budget is not None:
            req.budget.max_nodes, req.budget.max_depth, req.budget.max_width = (
                budget.max_nodes, budget.max_depth, budget.max_width)
        return req

    def generate(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kwargs) -> GenerationOutput:
        """Generate and return the whole result (arguments as in ``request``)."""
        req = self.request(prompt, **kwargs)
        try:
            resp = self.stub.GenerateUnary(req, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            _raise_from(exc)
        return GenerationOutput(
            token_ids=list(resp.token_ids), text=resp.text, finish_reason=resp.finish_reason,
            stats=_stats_dict(resp.stats),
        )

    def stream(self, prompt: Optional[str] = None, *, timeout: Optional[float] = None, **kwargs) -> Iterator[StreamChunk]:
        """Yield a ``StreamChunk`` per decoding step, the last with ``finished`` and totals."""
        req = self.request(prompt, **kwargs)
        call = self.stub.Generate(req, timeout=timeout or self.timeout)
        try:
            for msg in call:
                yield StreamChunk(
                    token_ids=list(msg.token_ids), text=msg.text, step=_stats_dict(msg.step),
                    finished=msg.finished, finish_reason=msg.finish_reason,
                    stats=_stats_dict(msg.stats) if msg.finished else {},
                )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                _raise_from(exc)
        finally:
            call.cancel()

    def health(self, service: str = "") -> str:
        """The server's grpc.health.v1 status name, e.g. ``SERVING``."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
