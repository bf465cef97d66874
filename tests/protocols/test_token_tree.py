"""TokenTree: derived structure, construction paths, batching, and clear errors on malformed trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from stree import TokenTree, TreeBatch
from stree.protocols.token_tree import MAX_TREE_NODES

from tree_strategies import parent_lists, token_trees


def test_structure_of_a_small_tree():
    t = TokenTree.from_parents([10, 11, 12, 13, 14], [-1, 0, 0, 1, 1])
    assert t.depth.tolist() == [0, 1, 1, 2, 2]
    assert t.position_ids(7).tolist() == [7, 8, 8, 9, 9]
    assert t.path(4) == [0, 1, 4]
    assert t.path_tokens(3) == [10, 11, 13]
    assert t.leaves() == [2, 3, 4]
    assert t.children() == [[1, 2], [3, 4], [], [], []]
    mask = t.ancestor_mask()
    assert mask[4].tolist() == [True, True, False, False, True]
    assert mask[2].tolist() == [True, False, True, False, False]


@given(parent_lists())
@settings(max_examples=60, deadline=None)
def test_ancestor_mask_matches_paths(parents):
    t = TokenTree.from_parents([0] * len(parents), parents)
    mask = t.ancestor_mask()
    for i in range(t.num_nodes):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(t.path(i))
        assert int(t.depth[i]) == len(t.path(i)) - 1


def test_from_sequences_prefix_merges():
    t = TokenTree.from_sequences(5, [[1, 2], [1, 3], [4], [1, 2, 9]])
    assert t.tokens.tolist() == [5, 1, 2, 3, 4, 9]
    assert t.parents.tolist() == [-1, 0, 1, 1, 0, 2]
    assert sorted(t.to_sequences()) == [[1, 2, 9], [1, 3], [4]]


@given(token_trees(vocab_size=8))
@settings(max_examples=40, deadline=None)
def test_sequences_round_trip(tree):
    again = TokenTree.from_sequences(int(tree.tokens[0]), tree.to_sequences())
    assert sorted(again.to_sequences()) == sorted(
        TokenTree.from_sequences(int(tree.tokens[0]), tree.to_sequences()).to_sequences()
    )
    # every root-to-leaf token path of the original is a path of the merged tree
    merged_paths = {tuple(again.path_tokens(i)) for i in range(again.num_nodes)}
    for leaf in tree.leaves():
        assert tuple(tree.path_tokens(leaf)) in merged_paths


def test_batch_pads_with_root_children():
    a = TokenTree.from_parents([1, 2, 3], [-1, 0, 1])
    b = TokenTree.from_parents([4], [-1])
    batch = TreeBatch.from_trees([a, b], pad_to=4)
    assert batch.tokens.shape == (2, 4)
    assert batch.parents[1].tolist() == [-1, 0, 0, 0]
    assert batch.num_nodes.tolist() == [3, 1]
    assert batch.depth[0, :3].tolist() == [0, 1, 2]
    mask = batch.ancestor_mask()
    assert torch.equal(mask[0, :3, :3], a.ancestor_mask())


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        ([], [], "at least the root"),
        ([1, 2], [-1], "2 tokens but 1 parents"),
        ([1, 2], [0, 0], "root must have parent -1"),
        ([1, 2, 3], [-1, 2, 0], "node 1 has parent 2"),
        ([1, 2, 3], [-1, 0, 5], "node 2 has parent 5"),
        ([1, 2, 3], [-1, 0, -1], "node 2 has parent -1"),
        ([1, -2], [-1, 0], "negative token id"),
        ([[1, 2]], [[-1, 0]], "must be 1-D"),
        ([1.5, 2.0], [-1, 0], "must be integers"),
    ],
)
def test_malformed_trees_raise_clear_errors(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.from_parents(tokens, parents)


def test_size_limit_and_vocab_check():
    n = MAX_TREE_NODES + 1
    with pytest.raises(ValueError, match="over the limit"):
        TokenTree.from_parents([0] * n, [-1] + list(range(n - 1)))
    t = TokenTree.from_parents([1, 70], [-1, 0])
    with pytest.raises(ValueError, match="outside the vocabulary of 64"):
        t.check_vocab(64)
    with pytest.raises(ValueError, match="needs draft_probs"):
        TokenTree.from_parents([1, 2], [-1, 0], mode="iid")
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        TokenTree.from_parents([1, 2], [-1, 0], draft_probs=torch.ones(3, 4), mode="iid")
    with pytest.raises(ValueError, match="not a valid DraftMode|is not a valid"):
        TokenTree.from_parents([1, 2], [-1, 0], mode="bogus")
