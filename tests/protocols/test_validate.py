"""protocols.validate: the one check of a drafted tree (root, vocabulary, draft_probs, budget)."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import protocols
from stree.protocols import DEFAULT_BUDGET, DraftBudget, DraftMode, TokenTree
from stree.protocols.validate import budget_problem, check_tree, tree_problem

from tree_strategies import token_trees

VOCAB = 16
BIG = DraftBudget(max_nodes=64, max_depth=16, max_width=8)


def _tree():
    return TokenTree.from_parents([5, 1, 2, 3], [-1, 0, 0, 1])


def test_a_good_tree_passes():
    t = _tree()
    assert tree_problem(t, 5, BIG, VOCAB) is None
    assert check_tree(t, 5, BIG, VOCAB) is t
    # numpy / 0-d tensor ids for root and vocab_size are fine
    assert tree_problem(t, np.int64(5), BIG, torch.tensor(VOCAB)) is None


@pytest.mark.parametrize("thing", [None, [5, 1], {"tokens": [5]}, "tree", 5, torch.tensor([5, 1])])
def test_not_a_token_tree(thing):
    why = tree_problem(thing, 5, BIG, VOCAB)
    assert why == f"drafter returned {type(thing).__name__}, not a TokenTree"
    with pytest.raises(ValueError, match="not a TokenTree"):
        check_tree(thing, 5, BIG, VOCAB)


def test_wrong_root():
    assert tree_problem(_tree(), 6, BIG, VOCAB) == "tree root token 5 is not the current last token 6"


def test_token_outside_vocabulary():
    assert tree_problem(_tree(), 5, BIG, 5) == "tree token 5 is outside the vocabulary of 5"
    assert tree_problem(_tree(), 5, BIG, 6) is None  # largest token = vocab - 1 is fine


def test_draft_probs_vocabulary_mismatch():
    t = TokenTree.from_parents([5, 1], [-1, 0], torch.full((2, 8), 0.125), DraftMode.IID)
    assert tree_problem(t, 5, BIG, VOCAB) == "draft_probs cover 8 tokens, the target has 16"
    assert tree_problem(t, 5, BIG, 8) is None


def test_tree_changed_in_place_after_construction():
    t = _tree()
    t.tokens[2] = -3  # a buggy drafter reaching into the tree it returned
    assert tree_problem(t, 5, BIG, VOCAB) == "tree token -3 is negative"


@pytest.mark.parametrize(
    "budget, message",
    [
        (DraftBudget(max_nodes=3, max_depth=8, max_width=4), "4 nodes > max_nodes 3"),
        (DraftBudget(max_nodes=16, max_depth=1, max_width=4), "depth 2 > max_depth 1"),
        (DraftBudget(max_nodes=16, max_depth=8, max_width=1), "a node has 2 children > max_width 1"),
    ],
)
def test_over_budget(budget, message):
    assert tree_problem(_tree(), 5, budget, VOCAB) == message
    assert budget.violation(_tree()) == message
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_tree(_tree(), 5, budget, VOCAB)
    with pytest.raises(ValueError, match=f"drafted tree is over budget: {message}"):
        budget.check(_tree())


def test_budget_limits_are_inclusive():
    exact = DraftBudget(max_nodes=4, max_depth=2, max_width=2)
    assert tree_problem(_tree(), 5, exact, VOCAB) is None
    assert exact.violation(_tree()) is None
    exact.check(_tree())
    root_only = TokenTree.chain([5])
    assert budget_problem(root_only, DraftBudget(max_nodes=1, max_depth=0, max_width=1)) is None


def test_checks_run_in_order():
    # not a tree, then root, then vocabulary, then draft_probs, then budget
    tiny = DraftBudget(max_nodes=1, max_depth=0, max_width=1)
    t = TokenTree.from_parents([5, 40], [-1, 0], torch.full((2, 41), 0.1), DraftMode.IID)
    assert "not the current last token" in tree_problem(t, 4, tiny, VOCAB)
    assert "outside the vocabulary" in tree_problem(t, 5, tiny, VOCAB)
    assert "draft_probs cover" in tree_problem(t, 5, tiny, 50)
    assert "max_nodes" in tree_problem(t, 5, tiny, 41)


@pytest.mark.parametrize(
    "root, budget, vocab, exc, message",
    [
        (True, BIG, VOCAB, ValueError, "root is the bool"),
        (5.0, BIG, VOCAB, ValueError, "root is 5.0"),
        ("5", BIG, VOCAB, TypeError, "root is a str"),
        (5, BIG, 0, ValueError, "vocab_size must be >= 1"),
        (5, BIG, 16.0, ValueError, "vocab_size is 16.0"),
        (5, BIG, None, TypeError, "vocab_size is a NoneType"),
        (5, None, VOCAB, TypeError, "budget must be a DraftBudget, got NoneType"),
        (5, (64, 16, 8), VOCAB, TypeError, "budget must be a DraftBudget, got tuple"),
    ],
)
def test_bad_arguments_of_the_check_itself(root, budget, vocab, exc, message):
    with pytest.raises(exc, match=message):
        tree_problem(_tree(), root, budget, vocab)
    with pytest.raises(exc, match=message):
        check_tree(_tree(), root, budget, vocab)


def test_default_budget_is_exported_once():
    assert DEFAULT_BUDGET == DraftBudget(max_nodes=64, max_depth=16, max_width=8)
    assert protocols.DEFAULT_BUDGET is DEFAULT_BUDGET and "DEFAULT_BUDGET" in protocols.__all__
    from stree.protocols.drafter import DEFAULT_BUDGET as from_drafter

    assert from_drafter is DEFAULT_BUDGET


def test_validate_imports_only_protocol_types():
    """validate.py may depend on protocols.token_tree and protocols.drafter only (no other stree code)."""
    src = pathlib.Path(protocols.__file__).with_name("validate.py").read_text()
    allowed_relative = {"token_tree", "drafter"}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.module in allowed_relative, node.module
            else:
                assert not (node.module or "").startswith("stree"), node.module
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("stree") for a in node.names)


def _reference_problem(tree, budget):
    """Budget check from scratch: node count, deepest path, most children of a node."""
    n = tree.num_nodes
    depth = max(len(tree.path(i)) - 1 for i in range(n))
    width = max(sum(1 for p in tree.parents.tolist() if p == i) for i in range(n))
    if n > budget.max_nodes:
        return f"{n} nodes > max_nodes {budget.max_nodes}"
    if depth > budget.max_depth:
        return f"depth {depth} > max_depth {budget.max_depth}"
    if width > budget.max_width:
        return f"a node has {width} children > max_width {budget.max_width}"
    return None


@given(
    token_trees(vocab_size=12, max_nodes=30),
    st.integers(1, 32),
    st.integers(0, 12),
    st.integers(1, 10),
    st.integers(8, 14),
    st.booleans(),
)
@settings(derandomize=True, deadline=None, max_examples=150)
def test_tree_problem_matches_a_reference(tree, max_nodes, max_depth, max_width, vocab, right_root):
    budget = DraftBudget(max_nodes=max_nodes, max_depth=max_depth, max_width=max_width)
    root = int(tree.tokens[0]) if right_root else int(tree.tokens[0]) + 1
    toks = tree.tokens.tolist()
    if not right_root:
        expect = f"tree root token {toks[0]} is not the current last token {root}"
    elif max(toks) >= vocab:
        expect = f"tree token {max(toks)} is outside the vocabulary of {vocab}"
    else:
        expect = _reference_problem(tree, budget)
    assert tree_problem(tree, root, budget, vocab) == expect
    assert budget.violation(tree) == _reference_problem(tree, budget)
    if expect is None:
        assert check_tree(tree, root, budget, vocab) is tree
    else:
        with pytest.raises(ValueError):
            check_tree(tree, root, budget, vocab)


@given(
    st.one_of(
        st.none(),
        st.integers(),
        st.text(max_size=3),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
        st.just(torch.zeros(2)),
        st.just(np.zeros(3)),
        token_trees(vocab_size=20, max_nodes=8),
    ),
    st.integers(0, 20),
    st.integers(1, 20),
)
@settings(derandomize=True, deadline=None, max_examples=100)
def test_tree_problem_never_raises_on_a_bad_tree(thing, root, vocab):
    why = tree_problem(thing, root, DEFAULT_BUDGET, vocab)
    assert why is None or (isinstance(why, str) and why)
    if why is None:
        assert isinstance(thing, TokenTree) and check_tree(thing, root, DEFAULT_BUDGET, vocab) is thing
