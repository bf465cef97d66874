"""What the loopback service tests share: a real local Ray + DrafterService stack, and polling."""

from __future__ import annotations

import contextlib
import sys
import time

import ray

from stree.drafter_service.actors import PoolConfig, init_ray
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.service import DrafterServer
from stree.proto.rpc import shared_loop
from stree.protocols import register_drafter


class HostNgramDrafter(NgramDrafter):
    """The n-gram drafter on the host only: a server whose default drafts on the host takes any registered drafter
    per request (a device-drafting server refuses other names), which the plugin-failure tests need."""

    name = "host-ngram"

    def device_drafter(self) -> None:
        return None


register_drafter("host-ngram", HostNgramDrafter, replace=True)


class TinyStack:
    """A tiny char-vocabulary Mamba2 checkpoint, loaded, with its tokenizer (servers get added by tests)."""

    def __init__(self, folder, seed: int, n_layer: int = 2):
        from stree.verifier.model.checkpoint import init_model, load_model
        from stree.verifier.model.tokenizer import load_tokenizer

        self.model_dir = init_model(folder / "tiny", arch="mamba2", d_model=32, n_layer=n_layer, vocab_size=64,
                                    seed=seed)
        self.model = load_model(self.model_dir)
        self.tok = load_tokenizer(self.model_dir)


@contextlib.contextmanager
def grpc_served(server):
    """``server`` (a GenerationServer) started on the shared loop; yields ``(channel, GenerationService stub)``
    and stops it on exit."""
    import grpc

    from stree.proto.stree.v1 import generation_pb2_grpc

    shared_loop().run(server.start())
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield channel, generation_pb2_grpc.GenerationServiceStub(channel)
    finally:
        shared_loop().run(server.stop(0), 30)


def wait_until(cond, timeout: float = 60.0) -> bool:
    """Poll ``cond`` every 50 ms until it holds or ``timeout`` passes; returns its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def stream_through_fault(client, prompt_ids, max_new_tokens: int, inject, drafter=None):
    """Stream a long generation through ``client``; ``inject()`` after the first accepted draft; stop once drafts
    are accepted again after a fallback. Returns (tokens, fallbacks seen, recovered)."""
    kwargs = {"drafter": drafter} if drafter is not None else {}
    stream = client.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, **kwargs)
    tokens, injected, fallbacks, recovered = [], False, 0, False
    try:
        for chunk in stream:
            tokens += chunk.token_ids
            step = chunk.step
            if not injected and step.get("accepted", 0) > 0:
                inject()
                injected = True
            elif injected:
                fallbacks += bool(step.get("fallback"))
                if fallbacks and step.get("accepted", 0) > 0:
                    recovered = True
                    break
    finally:
        stream.close()
    return tokens, fallbacks, recovered


@contextlib.contextmanager
def drafter_service(drafters, replicas: int = 1, options_for=None, test_module: str | None = None,
                    start_timeout: float = 240.0, **server_kwargs):
    """A running DrafterService on a fresh local Ray cluster; shut down (Ray included) on exit.

    ``test_module``: a test module whose drafter classes Ray workers must receive by value;
    ``server_kwargs``: more DrafterServer arguments (limits, credentials, api_key, call_timeout_s).
    """
    if test_module is not None:
        ray.cloudpickle.register_pickle_by_value(sys.modules[test_module])
    init_ray("local")
    loop = shared_loop()
    kwargs = dict(server_kwargs, **({"options_for": options_for} if options_for is not None else {}))
    srv = DrafterServer(port=0, drafters=list(drafters), pool_config=PoolConfig(replicas=replicas), **kwargs)
    try:
        loop.run(srv.start(), start_timeout)
        yield srv
    finally:
        loop.run(srv.stop(0), 30)
        ray.shutdown()
