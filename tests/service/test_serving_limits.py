"""The continuously batched server under abuse (gRPC, loopback): counts, never times.

Cancelled long prefills free their slots, a 3 MB prompt is refused unread, one abusive
client among 64 leaves the other 63 exact, and 1000 sequential requests leave sessions and RSS flat.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from service_helpers import TinyStack, wait_until
from stree.proto.rpc import shared_loop
from stree.proto.stree.v1 import generation_pb2_grpc
from stree.verifier.decode.loop import generate
from stree.verifier.service.client import Client
from stree.verifier.service.server import GenerationServer, ServerLimits

MAX_SEQ = 8192


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=6, n_layer=1)
    # every client here shares 127.0.0.1: the per-client cap must not stand for "64 clients"
    s.server = GenerationServer(s.model, s.tok, limits=ServerLimits(max_sessions=8, max_waiting=96,
                                                                    max_seq_len=MAX_SEQ, prefill_chunk=64,
                                                                    max_streams_per_client=128))
    shared_loop().run(s.server.start())
    yield s
    shared_loop().run(s.server.stop(0), 30)


def _idle(server) -> bool:
    return server.active_sessions() == 0 and all(r is None for r in server.core.engine.slots)


def test_cancelled_long_prefills_free_their_slots(stack):
    with grpc.insecure_channel(stack.server.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        calls = [stub.Generate(Client.request(prompt_ids=[(i + k) % 60 + 1 for k in range(8000)],
                                              max_new_tokens=100)) for i in range(8)]
        assert wait_until(lambda: stack.server.active_sessions() == 8)
        time.sleep(1.0)
        for call in calls:
            call.cancel()
    assert wait_until(lambda: _idle(stack.server))
    with Client(stack.server.address, timeout=60) as client:
        out = client.generate(prompt_ids=[3, 4, 5], max_new_tokens=8)
    assert out.token_ids == generate(stack.model, [3, 4, 5], max_new_tokens=8).token_ids


def test_one_abusive_client_among_64(stack):
    prompts = [[(i * 7 + k) % 63 + 1 for k in range(3 + i % 5)] for i in range(63)]
    want = [generate(stack.model, p, max_new_tokens=10).token_ids for p in prompts]
    got, errors, abuse = {}, [], {}

    def normal(i):
        try:
            with Client(stack.server.address, timeout=300) as client:
                got[i] = [t for c in client.stream(prompt_ids=prompts[i], max_new_tokens=10) for t in c.token_ids]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    def abusive():
        with Client(stack.server.address, timeout=300) as client:
            try:  # 3 MB of text: past the request size gRPC takes (the prompt byte cap + 1 MiB), never read
                client.generate("AB" * 1_500_000, max_new_tokens=4)
            except grpc.RpcError as exc:
                abuse["huge"] = (exc.code(), exc.details())
            for _ in range(3):  # long prompts, dropped after the first chunk
                stream = client.stream(prompt_ids=[5] * 6000, max_new_tokens=2000)
                next(stream)
                stream.close()
            abuse["done"] = True

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(63)] + [threading.Thread(target=abusive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert errors == [] and [got.get(i) for i in range(63)] == want
    assert abuse["huge"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in abuse["huge"][1]
    assert abuse["done"]
    assert wait_until(lambda: _idle(stack.server))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def test_1000_sequential_requests_leave_rss_and_sessions_flat(stack):
    with Client(stack.server.address, timeout=60) as client:
        for i in range(200):  # warm-up: allocator pools, gRPC buffers
            client.generate(prompt_ids=[i % 60 + 1, 2], max_new_tokens=2)
        before = _rss_kb()
        for i in range(1000):
            out = client.generate(prompt_ids=[i % 60 + 1, 2], max_new_tokens=2)
            assert len(out.token_ids) == 2
        after = _rss_kb()
    assert wait_until(lambda: _idle(stack.server))
    assert after - before < 64 * 1024, f"RSS grew by {after - before} kB over 1000 requests"
