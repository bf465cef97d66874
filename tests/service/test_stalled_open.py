"""A stalled drafter service (accepts TCP, never answers: a SIGSTOPped process) costs a request at most the
open timeout, a fraction of a second; drafting then falls back every step."""

from __future__ import annotations

import socket

import pytest

from stree.protocols import DraftBudget, SamplingParams
from stree.verifier.service.remote_drafter import DEFAULT_OPEN_TIMEOUT_S, DraftUnavailable, RemoteDrafter


@pytest.fixture
def stalled_port():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # the kernel completes handshakes; nobody ever reads
    yield sock.getsockname()[1]
    sock.close()


def test_open_against_a_stalled_service_returns_within_the_open_timeout(stalled_port):
    remote = RemoteDrafter(f"grpc://127.0.0.1:{stalled_port}/ngram", deadline_s=0.05)
    assert remote.open_timeout_s == DEFAULT_OPEN_TIMEOUT_S <= 0.25
    try:
        session = remote.open([1, 2, 3], SamplingParams(), budget=DraftBudget(max_nodes=4, max_depth=2, max_width=2))
        with pytest.raises(DraftUnavailable):
            session.draft(DraftBudget(max_nodes=4, max_depth=2, max_width=2))
        session.close()
    finally:
        remote.close()


def test_a_slow_deadline_keeps_a_matching_open_timeout_and_bad_values_are_refused():
    remote = RemoteDrafter("grpc://127.0.0.1:1/ngram", deadline_s=3.0)
    assert remote.open_timeout_s == 3.0
    remote.close()
    with pytest.raises(ValueError, match="open_timeout_s must be > 0"):
        RemoteDrafter("grpc://127.0.0.1:1/ngram", open_timeout_s=0)
