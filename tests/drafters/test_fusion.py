"""Tree fusion: merging deterministic trees under a budget, pluggable scoring, the FusionDrafter."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import DraftBudget, DraftMode, SamplingParams, TokenTree, create_drafter
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.drafter_service.drafters.fusion.fusion import FusionDrafter, merge_trees
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.drafters.retrieval.drafter import RetrievalDrafter
from stree.protocols import ContextSession, HostDrafter
from drafter_checks import assert_valid_draft, budgets, drafts_after_commits

GREEDY = SamplingParams()
WIDE = DraftBudget(max_nodes=64, max_depth=8, max_width=8)


def paths(tree: TokenTree) -> set[tuple]:
    return {tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)}


def test_union_is_prefix_merged():
    a = TokenTree.from_sequences(9, [[1, 2], [3]])
    b = TokenTree.from_sequences(9, [[1, 4], [3, 5]])
    merged = merge_trees([a, b], WIDE)
    assert_valid_draft(merged, [9], WIDE)
    assert paths(merged) == paths(a) | paths(b)
    assert merged.num_nodes == 6


def test_default_score_keeps_nodes_more_trees_agree_on():
    a = TokenTree.from_sequences(0, [[1, 2, 3]])
    b = TokenTree.from_sequences(0, [[4, 5], [1, 2, 6]])
    c = TokenTree.from_sequences(0, [[1, 2, 7]])
    merged = merge_trees([a, b, c], DraftBudget(max_nodes=4, max_depth=8, max_width=8))
    # "1 2" is in all three trees; then the tie among depth-1 "4" and depth-3 leaves goes to the shallower.
    assert paths(merged) == {(0,), (0, 1), (0, 1, 2), (0, 4)}


def test_scorer_decides_what_is_kept():
    a = TokenTree.from_sequences(0, [[1, 2]])
    b = TokenTree.from_sequences(0, [[3, 4]])

    def prefer_three(tree: TokenTree) -> torch.Tensor:
        return torch.tensor([0.0 if t == 0 else (-0.1 if t in (3, 4) else -5.0) for t in tree.tokens.tolist()])

    merged = merge_trees([a, b], DraftBudget(max_nodes=3, max_depth=4, max_width=2), prefer_three)
    assert merged.tokens.tolist() == [0, 3, 4]


def test_merge_rejects_bad_input():
    a = TokenTree.from_sequences(0, [[1]])
    with pytest.raises(ValueError, match="at least one"):
        merge_trees([], WIDE)
    with pytest.raises(ValueError, match="root token"):
        merge_trees([a, TokenTree.from_sequences(5, [[1]])], WIDE)
    sampled = TokenTree.from_parents([0, 1], [-1, 0], draft_probs=torch.full((2, 4), 0.25), mode=DraftMode.IID)
    with pytest.raises(ValueError, match="only merges deterministic"):
        merge_trees([a, sampled], WIDE)
    with pytest.raises(ValueError, match="shape"):
        merge_trees([a], WIDE, lambda tree: torch.zeros(5))
    with pytest.raises(ValueError, match="NaN"):
        merge_trees([a], WIDE, lambda tree: torch.full((tree.num_nodes,), float("nan")))


# ----- third-party-style drafters used to exercise fault handling ---------------------------------------
class BrokenSession(ContextSession):
    def draft(self, budget):
        raise RuntimeError("drafter crashed")


class BrokenDrafter(HostDrafter):
    """A plugin whose draft always raises."""

    name = "broken"

    def open(self, prompt_ids, params):
        return BrokenSession(prompt_ids, params)


class SamplingSession(ContextSession):
    def draft(self, budget):
        probs = torch.full((2, 8), 0.125)
        return TokenTree.from_parents([self.context[-1], 1], [-1, 0], draft_probs=probs, mode=DraftMode.IID)


class SamplingDrafter(HostDrafter):
    """A plugin whose trees are sampled (IID), which fusion must refuse."""

    name = "sampler"

    def open(self, prompt_ids, params):
        return SamplingSession(prompt_ids, params)


def test_failing_sub_drafter_is_skipped_with_a_warning(caplog):
    ctx = [1, 2, 3, 1, 2]
    fused = FusionDrafter([BrokenDrafter(), NgramDrafter()])
    assert fused.name == "broken+ngram"
    with caplog.at_level(logging.WARNING, logger="stree.drafter_service.drafters.fusion.fusion"):
        tree = fused.open(ctx, GREEDY).draft(WIDE)
    assert "broken failed to draft" in caplog.text
    alone = NgramDrafter().open(ctx, GREEDY).draft(WIDE)
    assert tree.tokens.tolist() == alone.tokens.tolist()
    only_broken = FusionDrafter([BrokenDrafter()]).open(ctx, GREEDY).draft(WIDE)
    assert only_broken.tokens.tolist() == [2]


def test_sampling_sub_drafter_is_refused():
    session = FusionDrafter([NgramDrafter(), SamplingDrafter()]).open([1, 2, 1], GREEDY)
    with pytest.raises(ValueError, match="only merges deterministic"):
        session.draft(WIDE)


def test_fusion_validates_its_arguments():
    with pytest.raises(ValueError, match="at least one"):
        FusionDrafter([])
    with pytest.raises(ValueError, match="not a Drafter"):
        FusionDrafter([object()])
    with pytest.raises(ValueError, match="non-empty"):
        FusionDrafter([NgramDrafter()]).open([], GREEDY)


def test_registered_fusion_with_scorer_feeds_context():
    store = Datastore.build([[5, 6, 7, 8], [5, 6, 9]], vocab_size=10)
    seen = []

    def scorer(context, tree):
        seen.append(list(context))
        return -tree.depth.float()

    fused = create_drafter("fusion", drafters=["ngram", ("retrieval", {"datastore": store})], scorer=scorer)
    session = fused.open([5, 6, 1, 5], GREEDY)
    session.commit([6])
    tree = session.draft(DraftBudget(max_nodes=4, max_depth=3, max_width=3))
    assert seen == [[5, 6, 1, 5, 6]]
    assert_valid_draft(tree, [5, 6, 1, 5, 6], DraftBudget(max_nodes=4, max_depth=3, max_width=3))
    assert sorted(tree.tokens.tolist()[1:]) == [1, 7, 9]  # every first-level option, shallow first
    session.close()


STORE = Datastore.build([[0, 1, 2, 3, 1, 2, 4], [2, 2, 3, 0], [4, 3, 2, 1, 0, 1]], vocab_size=6)
DRAFTERS = {
    "ngram": lambda: NgramDrafter(),
    "ngram-2-3": lambda: NgramDrafter(min_ngram=2, max_ngram=3, max_branches=3),
    "retrieval": lambda: RetrievalDrafter(STORE),
    "retrieval-short": lambda: RetrievalDrafter(STORE, max_suffix=2, max_occurrences=3),
}


@settings(max_examples=60, deadline=None)
@given(
    pair=st.lists(st.sampled_from(sorted(DRAFTERS)), min_size=2, max_size=2),
    prompt=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    steps=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=3),
    budget=budgets(),
)
def test_property_fusion_of_any_two(pair, prompt, steps, budget):
    """Fused drafts are valid in-budget trees, made only of paths some sub-drafter drafted, after any commits."""
    subs = [DRAFTERS[name]() for name in pair]
    session = FusionDrafter(subs).open(prompt, GREEDY)
    for tree, context in drafts_after_commits(session, prompt, steps, budget):
        fresh = [d.open(context, GREEDY).draft(budget) for d in subs]
        assert paths(tree) <= set().union(*(paths(t) for t in fresh))
        assert tree.tokens.tolist() == merge_trees(fresh, budget).tokens.tolist()
