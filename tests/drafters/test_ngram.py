"""N-gram (prompt lookup) drafter: matches, branching, budgets, incremental index, registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import DraftBudget, SamplingParams, create_drafter
from stree.drafter_service.drafters.ngram import NgramDrafter
from drafter_checks import assert_valid_draft, budgets, drafts_after_commits, occurs_in

GREEDY = SamplingParams()


def test_longest_match_continuation_is_drafted():
    # "7 1 2 3" occurred earlier followed by "8 9 5"; the context ends in "7 1 2 3" again.
    ctx = [4, 7, 1, 2, 3, 8, 9, 5, 6, 1, 2, 3, 0, 7, 1, 2, 3]
    tree = NgramDrafter(max_branches=1).open(ctx, GREEDY).draft(DraftBudget(max_nodes=8, max_depth=3, max_width=1))
    assert tree.tokens.tolist() == [3, 8, 9, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_several_matches_become_branches_most_recent_first():
    # "1 2" was followed by 5, then 6, then 7 (most recent); the context ends in "1 2".
    ctx = [1, 2, 5, 0, 1, 2, 6, 0, 1, 2, 7, 0, 1, 2]
    tree = NgramDrafter().open(ctx, GREEDY).draft(DraftBudget(max_nodes=16, max_depth=2, max_width=4))
    assert_valid_draft(tree, ctx, DraftBudget(max_nodes=16, max_depth=2, max_width=4))
    first_level = [tree.tokens[k].item() for k in tree.children()[0]]
    assert first_level == [7, 6, 5]
    assert sorted(tree.to_sequences()) == [[5, 0], [6, 0], [7, 0]]


def test_longer_ngram_matches_beat_shorter_ones():
    # Suffix "3 1 2": the bigram "1 2" was last followed by 9, but the trigram "3 1 2" by 4.
    ctx = [3, 1, 2, 4, 4, 1, 2, 9, 9, 3, 1, 2]
    tree = NgramDrafter(max_branches=4).open(ctx, GREEDY).draft(DraftBudget(max_nodes=2, max_depth=1, max_width=2))
    assert tree.tokens.tolist() == [2, 4]


def test_repeated_continuations_outrank_single_ones():
    ctx = [1, 5, 0, 1, 5, 0, 1, 6, 0, 1]  # after "1": 5 twice, 6 once (most recent)
    tree = NgramDrafter(max_ngram=1).open(ctx, GREEDY).draft(DraftBudget(max_nodes=2, max_depth=1, max_width=1))
    assert tree.tokens.tolist() == [1, 5]


def test_no_match_and_one_token_context_give_root_only():
    drafter = NgramDrafter()
    assert drafter.open([5], GREEDY).draft(DraftBudget()).tokens.tolist() == [5]
    assert drafter.open([1, 2, 3, 4], GREEDY).draft(DraftBudget()).tokens.tolist() == [4]


def test_empty_prompt_and_bad_options_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        NgramDrafter().open([], GREEDY)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_branches"):
        NgramDrafter(max_branches=0)


def test_closed_session_refuses_to_draft():
    session = NgramDrafter().open([1, 2, 1], GREEDY)
    session.close()
    with pytest.raises(ValueError, match="closed"):
        session.draft(DraftBudget())


def test_registered_by_name():
    drafter = create_drafter("ngram", max_ngram=3)
    assert drafter.name == "ngram" and drafter.max_ngram == 3
    tree = drafter.open([1, 2, 3, 1, 2], GREEDY).draft(DraftBudget(max_nodes=4, max_depth=3, max_width=1))
    assert tree.tokens.tolist() == [2, 3, 1, 2]


contexts = st.lists(st.integers(0, 5), min_size=1, max_size=60)
commits = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=4)


@settings(max_examples=80, deadline=None)
@given(
    prompt=contexts, steps=commits, budget=budgets(),
    min_n=st.integers(1, 3), extra_n=st.integers(0, 3), branches=st.integers(1, 8),
)
def test_property_valid_trees_and_incremental_index(prompt, steps, budget, min_n, extra_n, branches):
    """Every draft is a valid in-budget tree of real earlier continuations, and committing
    tokens one step at a time drafts exactly what a fresh session on the whole context drafts."""
    drafter = NgramDrafter(min_ngram=min_n, max_ngram=min_n + extra_n, max_branches=branches)
    session = drafter.open(prompt, GREEDY)
    for tree, context in drafts_after_commits(session, prompt, steps, budget):
        for node in range(1, tree.num_nodes):
            path = tree.path_tokens(node)  # root token, then the drafted continuation
            assert occurs_in(path, context, before=len(context) - 1)
        fresh = drafter.open(context, GREEDY).draft(budget)
        assert fresh.tokens.tolist() == tree.tokens.tolist()
        assert fresh.parents.tolist() == tree.parents.tolist()
