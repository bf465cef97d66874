"""A hand-driven DrafterService stream for tests: send requests one by one, read answers as they come."""

from __future__ import annotations

import queue

import grpc

from stree.proto.stree.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


class RawStream:
    """One Session stream over ``channel``; ``send`` queues a request, ``recv`` waits for the next answer."""

    def __init__(self, channel: grpc.Channel, metadata=(), timeout: float = 60.0):
        self._requests: queue.Queue = queue.Queue()
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        self.answers = stub.Session(iter(self._requests.get, None), timeout=timeout, metadata=metadata)

    def send(self, *requests) -> "RawStream":
        for req in requests:
            self._requests.put(req)
        return self

    def recv(self):
        return next(self.answers)

    def end(self) -> None:
        self._requests.put(None)


def open_req(prompt=(1, 2, 3), drafter="ngram", session_id="raw", **sampling):
    return drafter_pb2.DrafterRequest(open=drafter_pb2.OpenSession(
        session_id=session_id, prompt_ids=list(prompt), drafter=drafter, sampling=common_pb2.SamplingParams(**sampling)))


def draft_req(rid, length):
    return drafter_pb2.DrafterRequest(draft=drafter_pb2.DraftRequest(request_id=rid, context_length=length))


def commit_req(tokens, length):
    return drafter_pb2.DrafterRequest(commit=drafter_pb2.CommitTokens(tokens=list(tokens), context_length=length))


CLOSE = drafter_pb2.DrafterRequest(close=drafter_pb2.CloseSession())
