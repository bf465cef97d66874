"""Clients share the engine fairly: the queue is served round-robin over clients (fewest running first),
slots reserved for newcomers let a new client start while another holds long generations, and one client's
backlog never stands in front of another's first request. The order rules are checked directly, then on a
real HTTP server on loopback with two source addresses (127.0.0.1 and 127.0.0.2). Counts, never times."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx")

from service_helpers import TinyStack, wait_until  # noqa: E402
from stree.proto.rpc import shared_loop  # noqa: E402
from stree.verifier.decode.loop import generate  # noqa: E402
from stree.verifier.service.scheduler import ServedRequest, admissible, fair_order  # noqa: E402
from stree.verifier.service.server import GenerationServer, ServerLimits  # noqa: E402


def _reqs(spec: str) -> list[ServedRequest]:
    """One request per letter (its client), arriving in that order."""
    out = []
    for i, client in enumerate(spec):
        r = ServedRequest([1], client=client)
        r.submitted_s = float(i)
        out.append(r)
    return out


def test_fair_order_is_round_robin_starting_with_the_least_served_client():
    queued = _reqs("AAAAB" + "C")
    order = fair_order(queued, {"A": 3, "C": 1})
    assert "".join(r.client for r in order) == "BCAAAA"
    order = fair_order(_reqs("AAABBC"), {})
    assert "".join(r.client for r in order) == "ABCABA"
    assert [r.submitted_s for r in order if r.client == "A"] == [0.0, 1.0, 2.0]  # a client's own order kept


def test_reserved_slots_go_only_to_clients_running_nothing():
    order = fair_order(_reqs("AAAA"), {"A": 6})
    now, later = admissible(order, {"A": 6}, free=2, reserved=1)
    assert len(now) == 1 and len(later) == 3  # A may take one of two free slots, not the reserved last one
    now, later = admissible(fair_order(_reqs("AAAB"), {"A": 7}), {"A": 7}, free=1, reserved=1)
    # B fills every free slot; A's follow it in the engine's queue (which admits only as many as are free)
    assert [r.client for r in now] == ["B", "A", "A", "A"] and later == []
    now, later = admissible(fair_order(_reqs("AAA"), {}), {}, free=3, reserved=1)
    assert len(now) == 2 and len(later) == 1  # even alone, a client leaves the reserved slot free


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = TinyStack(tmp_path_factory.mktemp("m"), seed=61, n_layer=1)
    s.server = GenerationServer(s.model, s.tok, http_port=0, model_name="tiny",
                                limits=ServerLimits(max_sessions=4, max_waiting=32, max_seq_len=4096,
                                                    max_streams_per_client=16, reserved_slots=1))
    shared_loop().run(s.server.start())
    yield s
    shared_loop().run(s.server.stop(0), 30)


def test_a_newcomer_starts_while_another_client_holds_slots_and_a_backlog(stack):
    url = f"http://{stack.server.http.address}/v1/completions"
    long = {"model": "tiny", "prompt": "AB", "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    release = threading.Event()

    def hog():
        with httpx.Client(timeout=120) as http, http.stream("POST", url, json=long) as r:
            assert r.status_code == 200
            release.wait(120)

    hogs = [threading.Thread(target=hog) for _ in range(8)]
    for t in hogs:
        t.start()
    sched = stack.server.core.scheduler
    try:
        assert wait_until(lambda: sched.num_live == 8 and sched.num_running == 3)  # the 4th slot is reserved
        victim = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=victim, timeout=120) as http:
            out = http.post(url, json={"model": "tiny", "prompt": [5, 6], "max_tokens": 16, "temperature": 0})
        waiting_meanwhile = sched.num_waiting
    finally:
        release.set()
        for t in hogs:
            t.join(120)
    assert out.status_code == 200
    assert out.json()["choices"][0]["token_ids"] == generate(stack.model, [5, 6], max_new_tokens=16).token_ids
    assert waiting_meanwhile == 5  # the hog's backlog still queued: the newcomer went ahead of it
    assert wait_until(lambda: stack.server.active_sessions() == 0)
