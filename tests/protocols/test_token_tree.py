"""TokenTree: derived structure, construction paths, batching, and clear errors on malformed trees."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stree import TokenTree, TreeBatch
from stree.protocols.token_tree import MAX_TREE_NODES, DraftMode

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


# ===== hardening: every bad input is a ValueError/TypeError naming the field ====================
FUZZ = settings(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def assert_valid_tree(t) -> None:
    """Every invariant a constructed TokenTree promises, checked from scratch."""
    assert isinstance(t, TokenTree)
    n = t.num_nodes
    assert 1 <= n <= MAX_TREE_NODES and len(t) == n
    for name in ("tokens", "parents", "depth"):
        v = getattr(t, name)
        assert isinstance(v, torch.Tensor) and v.dtype == torch.long and v.device.type == "cpu"
        assert tuple(v.shape) == (n,), name
    toks, pars, deps = t.tokens.tolist(), t.parents.tolist(), t.depth.tolist()
    assert pars[0] == -1 and deps[0] == 0
    for i in range(1, n):
        assert 0 <= pars[i] < i
        assert deps[i] == deps[pars[i]] + 1
    assert min(toks) >= 0
    assert isinstance(t.mode, DraftMode)
    if t.draft_probs is None:
        assert n == 1 or t.mode is DraftMode.DETERMINISTIC
    else:
        q = t.draft_probs
        assert isinstance(q, torch.Tensor) and q.dtype in FLOAT_DTYPES
        assert q.dim() == 2 and q.shape[0] == n and q.shape[1] > max(toks)
        assert bool(torch.isfinite(q).all()) and bool((q >= 0).all())


FP, FS = TokenTree.from_parents, TokenTree.from_sequences


def _raises(exc, fn, *args, match=None, **kw):
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kw)
    return str(info.value)


# ----- previously accepted invalid trees, one test each ------------------------------------------
def test_nan_draft_probs_rejected():
    q = torch.full((2, 4), 0.25)
    q[1, 2] = float("nan")
    _raises(ValueError, FP, [1, 2], [-1, 0], q, "iid", match="draft_probs has NaN")


@pytest.mark.parametrize("value", [math.inf, -math.inf])
def test_infinite_draft_probs_rejected(value):
    q = torch.full((2, 4), 0.25, dtype=torch.float64)
    q[0, 0] = value
    _raises(ValueError, FP, [1, 2], [-1, 0], q, "iid", match="draft_probs has infinite")


def test_negative_draft_probs_rejected():
    q = torch.full((2, 4), 0.25)
    q[0, 3] = -1e-6
    _raises(ValueError, FP, [1, 2], [-1, 0], q, "iid", match="draft_probs has negative")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_floating_draft_probs_rejected(dtype):
    q = torch.ones(2, 4, dtype=dtype)
    _raises(ValueError, FP, [1, 2], [-1, 0], q, "iid", match="draft_probs must be float")


def test_integer_and_bool_draft_probs_lists_and_arrays_rejected():
    _raises(ValueError, FP, [1, 2], [-1, 0], [[0, 1], [1, 0]], "iid",
            match="draft_probs must be float")
    _raises(ValueError, FP, [1, 2], [-1, 0], [[True, False]] * 2, "iid",
            match="draft_probs must be float")
    _raises(ValueError, FP, [1, 2], [-1, 0], np.ones((2, 4), np.int32), "iid",
            match="draft_probs must be floating point")
    _raises(ValueError, FP, [1, 2], [-1, 0], np.ones((2, 4), bool), "iid",
            match="draft_probs must be floating point")


def test_complex_draft_probs_rejected():
    q = torch.ones(2, 4, dtype=torch.complex64)
    _raises(ValueError, FP, [1, 2], [-1, 0], q, "iid", match="draft_probs must be float")


def test_bool_tokens_in_a_list_rejected():
    # torch.as_tensor([5, True]) is an int64 tensor: a bool must be refused before it becomes token 1
    _raises(ValueError, FP, [5, True], [-1, 0], match=r"tokens\[1\] is the bool True")
    _raises(ValueError, FP, [5, 6], [-1, False], match=r"parents\[1\] is the bool")
    _raises(ValueError, FP, [5, np.bool_(True)], [-1, 0], match="bool")
    _raises(ValueError, FP, torch.tensor([True, False]), [-1, 0],
            match="tokens must be integers, got dtype torch.bool")


def test_chain_rejects_bool_and_float_tokens():
    _raises(ValueError, TokenTree.chain, [3, True], match=r"tokens\[1\] is the bool")
    _raises(ValueError, TokenTree.chain, [3, 2.0], match=r"tokens\[1\] is 2.0: ids must be integers")


def test_from_sequences_rejects_fractional_float_tokens():
    # int(1.7) would be token 1: a fractional id is refused, not truncated
    msg = _raises(ValueError, FS, 5, [[1.7, 2]], match=r"sequences\[0\]\[0\] is 1.7")
    assert "must be integers" in msg


def test_from_sequences_rejects_integral_float_tokens():
    # chosen: every float is rejected, even one that is integral like 2.0
    _raises(ValueError, FS, 5, [[1], [2.0]], match=r"sequences\[1\]\[0\] is 2.0")
    _raises(ValueError, FS, 5, [np.array([1.0, 2.0])], match="must be integers")
    _raises(ValueError, FS, 5, [[np.float32(3)]], match="must be integers")


def test_from_sequences_rejects_bool_tokens_and_bad_roots():
    _raises(ValueError, FS, 5, [[1, True]], match=r"sequences\[0\]\[1\] is the bool")
    _raises(ValueError, FS, 5.9, [[1]], match="root is 5.9")
    _raises(ValueError, FS, True, [[1]], match="root is the bool")
    _raises(TypeError, FS, "5", [[1]], match="root is a str")
    _raises(ValueError, FS, -1, [[1]], match="negative token id")


def test_float_tokens_rejected_even_when_integral():
    _raises(ValueError, FP, [1.0, 2.0], [-1, 0], match=r"tokens\[0\] is 1.0")
    _raises(ValueError, FP, [1, 2], [-1.0, 0], match=r"parents\[0\] is -1.0")
    _raises(ValueError, FP, np.array([1.0, 2.0]), [-1, 0], match="must be integers")
    _raises(ValueError, FP, [1, 2], torch.tensor([-1.0, 0.0]),
            match="parents must be integers")


def test_tokens_overflowing_int64_rejected():
    big = 2**63
    _raises(ValueError, FP, [1, big], [-1, 0], match="node 1 has token id .* does not fit int64")
    _raises(ValueError, TokenTree.chain, [1, 2**100], match="does not fit int64")
    _raises(ValueError, FS, 0, [[big]], match="does not fit int64")
    _raises(ValueError, FP, [1, -(2**70)], [-1, 0], match="negative token id")
    # uint64 values past int64 would wrap to negative ids
    u = torch.tensor([1, 2**64 - 1], dtype=torch.uint64)
    _raises(ValueError, FP, u, [-1, 0], match="does not fit int64")
    _raises(ValueError, FP, np.array([1, 2**63], np.uint64), [-1, 0], match="does not fit int64")


def test_parents_overflowing_int64_rejected():
    _raises(ValueError, FP, [1, 2], [-1, 2**64], match="node 1 has parent")
    _raises(ValueError, FP, [1, 2], [-(2**64), 0], match="root must have parent -1")


@pytest.mark.parametrize(
    "tokens, parents, message",
    [
        (np.array([[1, 2]]), [-1, 0], "tokens must be 1-D"),
        (torch.tensor([[1, 2]]), [-1, 0], "tokens must be 1-D"),
        (torch.tensor(3), [-1], "tokens must be 1-D"),
        (5, [-1], "tokens must be 1-D"),
        ([1, [2]], [-1, 0], r"tokens\[1\] is a list: ids must be 1-D"),
        ([1, torch.tensor([2])], [-1, 0], r"tokens\[1\] is a 1-D tensor"),
        ([1, 2], [[-1, 0]], r"parents\[0\] is a list"),
        ([1, 2], np.zeros((2, 1), np.int64), "parents must be 1-D"),
    ],
)
def test_wrong_dims_rejected(tokens, parents, message):
    _raises(ValueError, FP, tokens, parents, match=message)


@pytest.mark.parametrize(
    "tokens, message",
    [
        ({0: 1}, "tokens must be a list, tuple, 1-D tensor or 1-D array of integer ids, got a dict"),
        ("12", "got a str"),
        (b"12", "got a bytes"),
        (None, "got a NoneType"),
        ({1, 2}, "got a set"),
        ((x for x in [1]), "got a generator"),
        ([1, "2"], r"tokens\[1\] is a str, not an integer id"),
        ([1, None], r"tokens\[1\] is a NoneType"),
        (np.array(["a", "b"]), "numpy dtype <U1"),
        (torch.zeros(2).to_sparse(), "dense tensor"),
    ],
)
def test_wrong_kind_of_object_is_type_error(tokens, message):
    _raises(TypeError, FP, tokens, [-1, 0], match=message)


def test_draft_probs_wrong_kind_and_shape():
    _raises(TypeError, FP, [1, 2], [-1, 0], {"a": 1}, "iid", match="draft_probs must be")
    _raises(TypeError, FP, [1, 2], [-1, 0], "probs", "iid", match="draft_probs must be")
    _raises(TypeError, FP, [1, 2], [-1, 0], [["a"]], "iid", match="draft_probs is not")
    _raises(ValueError, FP, [1, 2], [-1, 0], [[0.5], [0.5, 0.5]], "iid",
            match="draft_probs is not a")
    _raises(ValueError, FP, [1, 2], [-1, 0], torch.ones(2, 4, 1), "iid",
            match=r"shape \[2, vocab\]")
    _raises(ValueError, FP, [1, 2], [-1, 0], torch.ones(8), "iid", match=r"shape \[2, vocab\]")
    _raises(ValueError, FP, [1, 2], [-1, 0], torch.ones(2, 0), "iid",
            match="outside draft_probs' vocabulary of 0")
    _raises(ValueError, FP, [1, 2], [-1, 0], torch.ones(2, 4, device="meta"), "iid",
            match="meta")


@pytest.mark.parametrize("mode", ["bogus", 3, None, [1], DraftMode])
def test_bad_mode_is_value_error(mode):
    _raises(ValueError, FP, [1, 2], [-1, 0], mode=mode, match="not a valid DraftMode")


def test_from_sequences_wrong_kinds():
    _raises(TypeError, FS, 1, 5, match="sequences must be an iterable")
    _raises(TypeError, FS, 1, "abc", match="sequences must be an iterable")
    _raises(TypeError, FS, 1, {(1, 2): 3}, match="sequences must be an iterable")
    _raises(TypeError, FS, 1, torch.tensor([1, 2]), match="sequences must be an iterable")
    _raises(TypeError, FS, 1, [[1], "ab"], match=r"sequences\[1\] must be")
    _raises(ValueError, FS, 1, [[1], 7], match=r"sequences\[1\] must be 1-D")
    _raises(ValueError, FS, 1, [list(range(MAX_TREE_NODES))], match="over the limit")
    many = [[i] for i in range(MAX_TREE_NODES + 5)]
    _raises(ValueError, FS, 1, many, match="over the limit")


def test_chain_edge_cases():
    _raises(ValueError, TokenTree.chain, [], match="at least the root")
    _raises(TypeError, TokenTree.chain, None, match="tokens must be")
    _raises(ValueError, TokenTree.chain, 7, match="must be 1-D")
    _raises(ValueError, TokenTree.chain, [0] * (MAX_TREE_NODES + 1), match="over the limit")
    assert TokenTree.chain(torch.tensor([4, 5, 6])).parents.tolist() == [-1, 0, 1]
    assert TokenTree.chain(range(3)).tokens.tolist() == [0, 1, 2]


def test_tree_batch_bad_inputs():
    a = TokenTree.chain([1, 2, 3])
    _raises(ValueError, TreeBatch.from_trees, [], match="at least one tree")
    _raises(TypeError, TreeBatch.from_trees, a, match="single TokenTree")
    _raises(TypeError, TreeBatch.from_trees, None, match="sequence of TokenTrees")
    _raises(TypeError, TreeBatch.from_trees, "ab", match="sequence of TokenTrees")
    _raises(TypeError, TreeBatch.from_trees, (t for t in [a]), match="sequence of TokenTrees")
    _raises(TypeError, TreeBatch.from_trees, [a, [1, 2]], match=r"trees\[1\] is a list, not a TokenTree")
    _raises(ValueError, TreeBatch.from_trees, [a], pad_to=2, match="smaller than a tree of 3")
    _raises(ValueError, TreeBatch.from_trees, [a], pad_to=-1, match="smaller")
    _raises(ValueError, TreeBatch.from_trees, [a], pad_to=2**40, match="over the limit")
    _raises(ValueError, TreeBatch.from_trees, [a], pad_to=4.0, match="pad_to is 4.0")
    _raises(ValueError, TreeBatch.from_trees, [a], pad_to=True, match="pad_to is the bool")
    _raises(TypeError, TreeBatch.from_trees, [a], pad_to="4", match="pad_to is a str")
    assert TreeBatch.from_trees((a,), pad_to=np.int64(5)).max_nodes == 5


# ----- accepted forms keep working -----------------------------------------------------------------
def test_accepted_input_forms():
    ref = TokenTree.from_parents([7, 8, 9], [-1, 0, 0])
    forms = [
        ((7, 8, 9), (-1, 0, 0)),
        (np.array([7, 8, 9], np.int32), np.array([-1, 0, 0], np.int8)),
        (torch.tensor([7, 8, 9], dtype=torch.uint8), torch.tensor([-1, 0, 0], dtype=torch.int16)),
        (torch.tensor([7, 8, 9], dtype=torch.uint32), torch.tensor([-1, 0, 0])),
        ([np.int64(7), torch.tensor(8), np.array(9)], [-1, np.int16(0), 0]),
        (np.array([7, 8, 9], dtype=object), [-1, 0, 0]),
        (range(7, 10), [-1, 0, 0]),
    ]
    for tokens, parents in forms:
        t = TokenTree.from_parents(tokens, parents)
        assert_valid_tree(t)
        assert t.tokens.tolist() == ref.tokens.tolist() and t.parents.tolist() == ref.parents.tolist()
    from_2d = TokenTree.from_sequences(np.int64(5), torch.tensor([[1, 2], [1, 3]]))
    assert from_2d.tokens.tolist() == [5, 1, 2, 3]
    assert TokenTree.from_sequences(5, [np.array([1, 2]), (1, 3), []]).parents.tolist() == [-1, 0, 1, 1]
    empty = TokenTree.from_sequences(5, [])
    assert empty.num_nodes == 1 and empty.tokens.tolist() == [5]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_draft_probs_float_dtypes_accepted(dtype):
    q = torch.full((2, 4), 0.25, dtype=dtype)
    t = TokenTree.from_parents([1, 2], [-1, 0], q, "without_replacement")
    assert t.draft_probs is q and t.mode is DraftMode.WITHOUT_REPLACEMENT
    zero_rows = torch.zeros(2, 4, dtype=dtype)  # leaves may carry all-zero rows
    assert_valid_tree(TokenTree.from_parents([1, 2], [-1, 0], zero_rows, "iid"))


def test_draft_probs_numpy_and_lists_accepted():
    arr = np.full((2, 4), 0.25, np.float32)
    t = TokenTree.from_parents([1, 2], [-1, 0], arr, "iid")
    assert t.draft_probs.dtype == torch.float32 and t.draft_probs.shape == (2, 4)
    swapped = np.full((2, 4), 0.25, ">f8")[:, ::-1]  # non-native byte order, negative strides
    assert_valid_tree(TokenTree.from_parents([1, 2], [-1, 0], swapped, "iid"))
    assert_valid_tree(TokenTree.from_parents([0, 1], [-1, 0], [[0.5, 0.5], [1, 0.0]], "iid"))
    _raises(TypeError, FP, [1, 2], [-1, 0], np.array([["a"] * 4] * 2), "iid",
            match="draft_probs must be floating point")
    _raises(ValueError, FP, [1, 2], [-1, 0], np.full((2, 4), np.nan), "iid", match="NaN")


def test_tokens_and_parents_are_copied():
    tokens, parents = torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1])
    t = TokenTree.from_parents(tokens, parents)
    tokens[1], parents[2] = -5, 2  # the caller reuses its buffers: the tree must not change
    assert t.tokens.tolist() == [1, 2, 3] and t.parents.tolist() == [-1, 0, 1]
    assert_valid_tree(t)
    arr = np.array([1, 2, 3])
    t = TokenTree.chain(arr)
    arr[0] = -1
    assert t.tokens.tolist() == [1, 2, 3]


# ----- property tests: valid trees round-trip -------------------------------------------------------
@given(token_trees(vocab_size=6, max_nodes=40), st.sampled_from(["list", "tuple", "tensor", "int32", "np"]))
@FUZZ
def test_valid_trees_round_trip(tree, form):
    assert_valid_tree(tree)
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    conv = {
        "list": lambda v: list(v),
        "tuple": tuple,
        "tensor": torch.tensor,
        "int32": lambda v: torch.tensor(v, dtype=torch.int32),
        "np": np.array,
    }[form]
    again = TokenTree.from_parents(conv(toks), conv(pars))
    assert again.tokens.tolist() == toks and again.parents.tolist() == pars
    assert again.depth.tolist() == tree.depth.tolist()
    n = tree.num_nodes
    mask = tree.ancestor_mask()
    kids = tree.children()
    assert sum(len(k) for k in kids) == n - 1
    for i in range(n):
        path = tree.path(i)
        assert path[0] == 0 and path[-1] == i
        assert all(pars[b] == a for a, b in zip(path, path[1:]))
        assert int(tree.depth[i]) == len(path) - 1
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(path)
        if i:  # row i is row parent(i) plus i itself
            expect = mask[pars[i]].clone()
            expect[i] = True
            assert torch.equal(mask[i], expect)
        assert all(pars[c] == i for c in kids[i])
    assert tree.leaves() == [i for i in range(n) if not kids[i]]
    assert tree.max_depth == max(tree.depth.tolist())
    # to_sequences / from_sequences: prefix-merging keeps exactly the set of token paths
    merged = TokenTree.from_sequences(toks[0], tree.to_sequences())
    assert_valid_tree(merged)
    def paths(t):
        return {tuple(t.path_tokens(i)) for i in range(t.num_nodes)}

    assert paths(merged) == paths(tree)
    assert merged.num_nodes == len(paths(tree))  # a trie: one node per distinct token path
    all_paths = paths(tree)
    maximal = {p[1:] for p in all_paths if not any(len(q) > len(p) and q[: len(p)] == p for q in all_paths)}
    assert sorted(map(tuple, merged.to_sequences())) == sorted(maximal)
    twice = TokenTree.from_sequences(toks[0], merged.to_sequences())
    assert twice.num_nodes == merged.num_nodes and paths(twice) == paths(merged)


@given(st.lists(token_trees(vocab_size=9, max_nodes=12), min_size=1, max_size=4), st.integers(0, 3))
@FUZZ
def test_tree_batch_round_trip(trees, extra):
    pad_to = max(t.num_nodes for t in trees) + extra
    batch = TreeBatch.from_trees(trees, pad_to=pad_to)
    assert batch.batch_size == len(trees) and batch.max_nodes == pad_to
    mask = batch.ancestor_mask()
    for k, t in enumerate(trees):
        m = t.num_nodes
        assert int(batch.num_nodes[k]) == m
        assert batch.tokens[k, :m].tolist() == t.tokens.tolist()
        assert batch.parents[k, :m].tolist() == t.parents.tolist()
        assert batch.depth[k, :m].tolist() == t.depth.tolist()
        assert batch.parents[k, m:].tolist() == [0] * (pad_to - m)
        assert batch.depth[k, m:].tolist() == [1] * (pad_to - m)
        assert torch.equal(mask[k, :m, :m], t.ancestor_mask())
        assert not mask[k, :m, m:].any()  # no real node descends from padding


# ----- fuzz: junk in, only ValueError/TypeError out, and anything accepted is valid ----------------
_NP_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
              "float32", "float64", "bool", "complex64", "object", "U3", "datetime64[s]"]
_TORCH_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                 torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                 torch.uint16, torch.uint32, torch.uint64]

_scalars = st.one_of(
    st.integers(-3, 40),
    st.integers(),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 2.0, 1.7, -0.0]),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.complex_numbers(max_magnitude=10),
    st.sampled_from([np.int64(3), np.uint64(2**64 - 1), np.float32(1.0), np.bool_(True), np.int8(-1),
                     torch.tensor(2), torch.tensor(1.5), torch.tensor(True), object(), DraftMode.IID]),
)


@st.composite
def _arrays(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape)) if shape else 1
    dtype = draw(st.sampled_from(_NP_DTYPES))
    base = np.array(draw(st.lists(st.integers(-2, 50), min_size=size, max_size=size)) or [0])[:size]
    if dtype == "object":
        items = draw(st.lists(_scalars, min_size=size, max_size=size)) + [None]  # [None]: never ragged
        return np.array(items, dtype=object)[:size].reshape(shape)
    if dtype.startswith("U"):
        return base.astype(str).astype(dtype).reshape(shape)
    with np.errstate(all="ignore"):
        arr = base.astype(dtype).reshape(shape)
    if arr.dtype.kind == "f" and arr.size and draw(st.booleans()):
        arr.flat[0] = draw(st.sampled_from([np.nan, np.inf, -np.inf, -1.0]))
    return arr


@st.composite
def _tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape)) if shape else 1
    dtype = draw(st.sampled_from(_TORCH_DTYPES))
    vals = draw(st.lists(st.integers(-2, 50), min_size=size, max_size=size))
    t = torch.tensor(vals, dtype=torch.int64).reshape(shape)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        t = t.abs().to(dtype)
    else:
        t = t.to(dtype)
    if t.is_floating_point() and t.numel() and draw(st.booleans()):
        t.view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0]))
    return t


_junk = st.recursive(
    st.one_of(_scalars, _arrays(), _tensors()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.integers(0, 3), inner, max_size=2),
        st.lists(st.integers(0, 3), max_size=3).map(set),
    ),
    max_leaves=8,
)


@st.composite
def _tree_fields(draw):
    """(tokens, parents, draft_probs, mode): each field valid, subtly broken, or plain junk."""
    n = draw(st.integers(1, 6))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    vocab = 10

    def field(valid, *broken):
        return draw(st.one_of(st.just(valid), *broken, _junk))

    t_field = field(tokens, st.just(torch.tensor(tokens)), st.just(np.array(tokens, np.uint16)),
                    st.just([float(t) for t in tokens]), st.just(tokens[:-1] + [True]),
                    st.just(tokens[:-1] + [2**63]), st.just(tokens[:-1] + [-1]))
    p_field = field(parents, st.just(torch.tensor(parents, dtype=torch.int32)), st.just(parents[:-1] + [n]),
                    st.just(parents[:-1] + [2**64]), st.just([0] + parents[1:]))
    q = torch.rand(n, vocab)
    bad_q = q.clone()
    bad_q[0, 0] = draw(st.sampled_from([float("nan"), float("inf"), -1.0]))
    q_field = field(None, st.just(q), st.just(bad_q), st.just(q.numpy()), st.just(q.long()),
                    st.just(q[:, :2]), st.just(q.half()), st.just(q.tolist()), st.just(q[None]))
    m_field = field(DraftMode.DETERMINISTIC, st.sampled_from(list(DraftMode)),
                    st.sampled_from(["iid", "IID", ""]))
    return t_field, p_field, q_field, m_field


def _call(fn, *args, **kw):
    """Only ValueError/TypeError may come out; whatever is returned must be a valid tree."""
    try:
        out = fn(*args, **kw)
    except (ValueError, TypeError) as exc:
        assert str(exc), "error without a message"
        event(f"rejected: {type(exc).__name__}")
        return None
    event("accepted")
    return out


@given(_tree_fields())
@settings(FUZZ, max_examples=300)
def test_fuzz_token_tree_constructor(fields):
    tokens, parents, probs, mode = fields
    for fn in (lambda: TokenTree(tokens, parents, probs, mode),
               lambda: TokenTree.from_parents(tokens, parents, draft_probs=probs, mode=mode)):
        out = _call(fn)
        if out is not None:
            assert_valid_tree(out)


@given(_junk, _junk, _junk, _junk)
@settings(FUZZ, max_examples=200)
def test_fuzz_constructors_with_junk(a, b, c, d):
    for fn in (lambda: TokenTree(a, b, c, d), lambda: TokenTree.from_parents(a, b),
               lambda: TokenTree.from_parents([0], [-1], c, d), lambda: TokenTree.chain(a),
               lambda: TokenTree.from_sequences(a, b), lambda: TokenTree.from_sequences(3, a)):
        out = _call(fn)
        if out is not None:
            assert_valid_tree(out)
    for trees in ([TokenTree.chain([1, 2])], a, [a], [TokenTree.chain([3]), b]):
        batch = _call(TreeBatch.from_trees, trees, pad_to=c if isinstance(c, (int, float)) else None)
        if batch is not None:
            assert isinstance(batch, TreeBatch) and batch.tokens.shape == batch.parents.shape


@given(st.integers(0, 5), st.lists(st.one_of(st.lists(_scalars, max_size=4), _junk), max_size=4))
@settings(FUZZ, max_examples=200)
def test_fuzz_from_sequences(root, sequences):
    out = _call(TokenTree.from_sequences, root, sequences)
    if out is not None:
        assert_valid_tree(out)
        # every sequence it accepted is a path of the tree, token for token
        paths = {tuple(out.path_tokens(i)[1:]) for i in range(out.num_nodes)}
        for seq in sequences:
            assert tuple(int(x) for x in (seq.tolist() if hasattr(seq, "tolist") else seq)) in paths


@pytest.mark.parametrize("spec,chain", [("chain:4", True), ("static:1,1,1", True), ("static:3,1,1", False),
                                        ("beam:4x3", False), ("none", False), ("dynamic:16", False)])
def test_tree_shape_is_chain_iff_its_layout_is_one_chain(spec, chain):
    from stree.protocols.tree_shape import TreeShape

    shape = TreeShape.parse(spec)
    assert shape.is_chain == chain
    if chain:
        assert shape.static_parents() == list(range(-1, shape.num_nodes - 1))


def test_tree_batch_keeps_its_chain_hint_across_devices():
    t = torch.zeros(1, 3, dtype=torch.long)
    batch = TreeBatch(t, torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.tensor([3]), is_chain=True)
    assert batch.to("cpu").is_chain and not TreeBatch(t, t, t, torch.tensor([3])).is_chain
