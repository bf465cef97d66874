"""A server whose drafter is ``ngram`` (``stree serve`` without a draft model) drafts on the device, in the engine's
step: its output equals plain greedy, and a request may still ask for no drafting."""

from __future__ import annotations

import pytest

import stree
from stree.drafter_service.drafters.lookup.device_base import LookupDeviceDrafter
from stree.proto.rpc import shared_loop
from stree.verifier.model.tokenizer import load_tokenizer
from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, ServerLimits

from lookup_helpers import looping_target


@pytest.fixture(scope="module")
def served(model_dirs):
    model = looping_target(False, 0)
    srv = GenerationServer(model, load_tokenizer(model_dirs["mamba2"]), EmbeddedDrafters("ngram"),
                           limits=ServerLimits(max_sessions=2, max_seq_len=128), model_name="loop")
    shared_loop().run(srv.start())
    yield model, srv
    shared_loop().run(srv.stop(0), 30)


def test_ngram_server_drafts_on_the_device_with_exact_output(served):
    model, srv = served
    assert isinstance(srv.core.engine.drafter.drafter, LookupDeviceDrafter)
    assert srv.core.device_drafter_name == "ngram"
    client = stree.Client(srv.address)
    prompt = [3, 9, 27, 3, 9]
    plain = stree.generate(model, prompt, max_new_tokens=40).token_ids
    for drafter in ("", "ngram", "none"):
        out = client.generate(prompt_ids=prompt, max_new_tokens=40, drafter=drafter)
        assert out.token_ids == plain, drafter
