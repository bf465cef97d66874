"""Sampled output through a remote drafter (a DrafterService on loopback, its drafters Ray actors) has the target's
distribution, with and without drafting ahead: chi-square of the first two tokens against the exact law (alpha
1e-3 per test). The trees and their draft probabilities cross gRPC, so a rounding or a lost field there would bias
the output. One ``stree.generate`` call takes one seed for all its requests, so each request and its drafter session
must draw on a seed of their own (``session_seeds``, ``session_params``): sessions drawing alike would make every
request's tree one draw, which this test rejects."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

import stree  # noqa: E402
from sampling_pair import sharpened_pair  # noqa: E402
from service_helpers import drafter_service  # noqa: E402
from stat_helpers import chisquare_pvalue, exact_sequence_distribution  # noqa: E402
from stree.protocols import DraftBudget, SamplingParams  # noqa: E402
from stree.protocols.sampling import warp_logits  # noqa: E402
from stree.verifier.model.checkpoint import save_model  # noqa: E402
from stree.verifier.service.remote_drafter import RemoteDrafter  # noqa: E402

ALPHA = 1e-3
SAMPLES = 800
PROMPT = [1, 4, 2]
BUDGET = DraftBudget(max_nodes=8, max_depth=3, max_width=3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_law")
    target, draft = sharpened_pair(root)
    draft_dir = save_model(draft, root / "draft")
    options = {"static-tree": {"draft_model": str(draft_dir), "tree_widths": "3,2"},
               "mamba": {"draft_model": str(draft_dir), "tree": "beam:2x2"}}
    with drafter_service(["static-tree", "mamba"], options_for=lambda name: options[name]) as service:
        yield target, f"grpc://{service.address}"


def _law(target, params):
    def next_probs(ctx):
        return warp_logits(target.score_sequence(torch.tensor(ctx))[-1], params).double()

    return exact_sequence_distribution(next_probs, PROMPT, 2)


def _pvalue(target, drafter, params) -> float:
    outs = stree.generate(target, [PROMPT] * SAMPLES, drafter=drafter, max_new_tokens=2,
                          temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=2000,
                          max_batch=64)
    return chisquare_pvalue([tuple(o.token_ids) for o in outs], _law(target, params))


@pytest.mark.slow
@pytest.mark.parametrize("name, overlap, params", [
    ("static-tree", 0, SamplingParams(temperature=1.0)),
    ("static-tree", 2, SamplingParams(temperature=0.8, top_k=4)),
    ("mamba", 2, SamplingParams(temperature=1.0, top_p=0.9)),
], ids=["wor", "wor-ahead-topk", "beam-ahead-topp"])
def test_remote_sampling_keeps_the_target_law(stack, name, overlap, params):
    target, url = stack
    drafter = RemoteDrafter(f"{url}/{name}", deadline_s=5.0, budget=BUDGET, overlap=overlap)
    try:
        p = _pvalue(target, drafter, params)
    finally:
        drafter.close()
    assert p > ALPHA, f"sampled output through the remote {name} drafter does not follow the target's law (p={p:.2e})"
