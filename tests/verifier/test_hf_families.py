"""Hugging Face hybrid classes loaded from transformers' own tiny random checkpoints match transformers exactly."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.verifier.model.checkpoint import load_model
from hf_helpers import BUILDERS, DRAFTS, V, check_scores, hf_greedy, save_tiny

transformers = pytest.importorskip("transformers")


@pytest.fixture(params=sorted(BUILDERS))
def family(request, tmp_path):
    hf = BUILDERS[request.param]()
    return request.param, hf, load_model(save_tiny(hf, tmp_path / request.param, shard="20KB"))


def test_scores_match_transformers(family):
    _, hf, model = family
    check_scores(model, hf, V)


@pytest.mark.parametrize("tree", ["chain:4", "static:2,2,1", "beam:3x2"])
def test_greedy_speculation_equals_transformers_greedy(family, tmp_path, tree):
    name, hf, model = family
    draft = BUILDERS[name](**DRAFTS[name])
    draft_model = load_model(save_tiny(draft, tmp_path / "draft"))
    prompt = torch.randint(0, V, (6,)).tolist()
    out = stree.generate(model, prompt, drafter="mamba", draft_model=draft_model, max_new_tokens=12, tree=tree,
                         cuda_graphs=False)
    assert out.token_ids == hf_greedy(hf, prompt, 12)
