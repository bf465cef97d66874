"""An in-process drafter whose trees carry NaN or negative draft_probs costs that step its draft, never the run."""

from __future__ import annotations

import pytest
import torch

import stree
from stree import DraftBudget, TokenTree
from stree.protocols.drafter import ContextSession, HostDrafter
from stree.protocols.token_tree import DraftMode

BUDGET = DraftBudget(max_nodes=8, max_depth=4, max_width=4)


class _PoisonedProbsDrafter(HostDrafter):
    """Every draft is an IID tree whose draft_probs hold ``value`` (NaN, -0.5, ...) in one row."""

    name = "poisoned-probs"

    def __init__(self, value: float, after_construction: bool):
        self.value = value
        self.after_construction = after_construction  # poison a validated tree in place

    def open(self, prompt_ids, params):
        drafter = self

        class Session(ContextSession):
            def draft(self, budget):
                root = self.context[-1]
                probs = torch.full((3, 64), 1.0 / 64)
                if not drafter.after_construction:
                    probs[1, 7] = drafter.value
                tree = TokenTree.from_parents([root, 1, 2], [-1, 0, 0], draft_probs=probs, mode=DraftMode.IID)
                if drafter.after_construction:
                    tree.draft_probs[1, 7] = drafter.value
                return tree

        return Session(prompt_ids, params)


@pytest.mark.parametrize("value", [float("nan"), -0.5, float("inf")])
@pytest.mark.parametrize("after_construction", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_poisoned_draft_probs_fall_back_and_keep_output(models, value, after_construction, temperature):
    target = models["hybrid"]
    drafter = _PoisonedProbsDrafter(value, after_construction)
    got = stree.generate(target, [5, 6, 7], drafter=drafter, max_new_tokens=10, temperature=temperature, seed=3,
                         budget=BUDGET)
    assert len(got.token_ids) == 10
    assert all(0 <= t < target.vocab_size for t in got.token_ids)
    if temperature == 0.0:  # greedy output is fixed: a bad tree may cost speed, never tokens
        assert got.token_ids == stree.generate(target, [5, 6, 7], max_new_tokens=10).token_ids
    else:  # sampled steps read draft_probs: every poisoned tree must have been dropped
        assert got.stats["drafter_fallbacks"] >= 1
