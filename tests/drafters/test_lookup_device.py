"""Lookup drafting on the device equals the host drafters' trees: the n-gram match, the retrieval search, the shared
tree rule, and the bookkeeping of slot histories across drafts, commits, plain steps and idle slots."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import DraftBudget, SamplingParams, TokenTree
from stree.drafter_service.drafters.lookup.device_tree import compact, lookup_trees
from stree.drafter_service.drafters.lookup.ngram_device import NgramDeviceDrafter
from stree.drafter_service.drafters.lookup.rule import lookup_tree, ngram_candidates, sample_slots
from stree.drafter_service.drafters.lookup.suffix_search import search_rounds, suffix_ranges
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.drafter_service.drafters.retrieval.drafter import RetrievalDrafter
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape
from drafter_checks import assert_valid_draft

GREEDY = SamplingParams()


def lookup_spec(branches: int, depth: int) -> TreeShape:
    return TreeShape.parse(f"lookup:chain:{depth}" if branches == 1 else f"lookup:trie:{depth}x{branches}")


def budget_of(shape: TreeShape) -> DraftBudget:
    """The host budget whose largest lookup layout is ``shape``."""
    return DraftBudget(max_nodes=shape.num_nodes, max_depth=shape.max_depth, max_width=shape.max_width)


def device_trees(drafter, shape: TreeShape, contexts: list[list[int]], capacity: int = 64):
    """Each context's tree from ``drafter``'s device drafter (slots prefilled with all but the root)."""
    dev = drafter.device_drafter().drafter
    dev.new_slots(len(contexts), capacity)
    dev.prefill_slots(list(range(len(contexts))), [c[:-1] for c in contexts])
    roots = torch.tensor([c[-1] for c in contexts])
    d = dev.draft(shape, roots, RowSampling.greedy(len(contexts), "cpu"), False)
    return dev, d, compact(d.tokens, d.parents, d.valid)


def host_tree(drafter, shape: TreeShape, context: list[int]) -> tuple[list[int], list[int]]:
    tree = drafter.open(context, GREEDY).draft(budget_of(shape))
    return tree.tokens.tolist(), tree.parents.tolist()


# ----- the shared rule ------------------------------------------------------------------------------
def test_rule_prefers_priority_then_support_then_earlier_rows_and_merges_prefixes():
    rows = [[5, 6], [7, 8, 9], [7, 8, 1], [7, 8, 9], [5]]
    # scores (prefix counts summed): 3, 8, 7, 8, 2; row 3 repeats row 1 and row 4 is a prefix of row 0: redundant
    tree = lookup_tree(3, rows, [1] * 5, branches=3, depth=3)
    assert tree.tokens.tolist() == [3, 7, 5, 8, 6, 9, 1]  # level by level, branches in rank order, "7 8" shared
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 3]
    first = lookup_tree(3, rows, [1, 1, 1, 1, 2], branches=2, depth=3)  # priority first: row 4 ([5]) leads
    assert first.to_sequences() == [[5], [7, 8, 9]]
    assert lookup_tree(3, [[], []], [0, 0], branches=2, depth=3).tokens.tolist() == [3]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), k=st.integers(1, 6), horizon=st.integers(1, 5))
def test_rule_on_the_device_equals_the_host_rule(data, batch, k, horizon):
    branches = data.draw(st.integers(1, k))
    depth = data.draw(st.integers(1, horizon))
    rows = torch.tensor(data.draw(st.lists(st.lists(st.lists(st.integers(0, 2), min_size=horizon, max_size=horizon),
                                                    min_size=k, max_size=k), min_size=batch, max_size=batch)))
    lengths = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, horizon), min_size=k, max_size=k),
                                              min_size=batch, max_size=batch)))
    priority = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 2), min_size=k, max_size=k),
                                               min_size=batch, max_size=batch)))
    roots = torch.arange(batch)
    got = compact(*lookup_trees(roots, rows, lengths, priority, branches, depth))
    for b in range(batch):
        host = [rows[b, i, : lengths[b, i]].tolist() for i in range(k)]
        tree = lookup_tree(b, host, priority[b].tolist(), branches, depth)
        assert got[b] == (tree.tokens.tolist(), tree.parents.tolist())
        assert_valid_draft(tree, [b], DraftBudget(max_nodes=branches * depth + 1, max_depth=depth,
                                                  max_width=branches))


# ----- n-gram ---------------------------------------------------------------------------------------
EDGE_CONTEXTS = [
    [5],  # one token: nothing to match
    [1, 2, 3, 4],  # no repeated token
    [3, 3, 3, 3, 3, 3],  # matches at the very end (the continuation runs into the root)
    [1, 2, 5, 0, 1, 2, 6, 0, 1, 2, 7, 0, 1, 2],  # repeated matches, three continuations
    [4, 7, 1, 2, 3, 8, 9, 5, 6, 1, 2, 3, 0, 7, 1, 2, 3],  # a longer match beats a more recent shorter one
]


@pytest.mark.parametrize("branches, depth", [(1, 4), (3, 2), (4, 5)])
def test_ngram_device_equals_host_on_edge_cases(branches, depth):
    shape = lookup_spec(branches, depth)
    drafter = NgramDrafter(lookup_tree=shape)
    _, _, got = device_trees(drafter, shape, EDGE_CONTEXTS)  # one batch of ragged lengths
    for context, tree in zip(EDGE_CONTEXTS, got):
        assert tree == host_tree(drafter, shape, context), context
    assert got[0] == ([5], [-1]) and got[1] == ([4], [-1])


@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=5),
       branches=st.integers(1, 4), depth=st.integers(1, 6), min_n=st.integers(1, 2), extra_n=st.integers(0, 3),
       scan=st.integers(0, 6))
def test_ngram_device_equals_host(contexts, branches, depth, min_n, extra_n, scan):
    shape = lookup_spec(branches, depth)
    drafter = NgramDrafter(min_ngram=min_n, max_ngram=min_n + extra_n, max_scan=branches + scan, lookup_tree=shape)
    _, _, got = device_trees(drafter, shape, contexts)
    for context, tree in zip(contexts, got):
        assert tree == host_tree(drafter, shape, context)


@settings(max_examples=40, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=50), min_n=st.integers(1, 3),
       extra_n=st.integers(0, 3), scan=st.integers(1, 10))
def test_ngram_session_index_finds_the_reference_candidates(context, min_n, extra_n, scan):
    drafter = NgramDrafter(min_ngram=min_n, max_ngram=min_n + extra_n, max_scan=scan)
    session = drafter.open(context, GREEDY)
    assert session.candidates() == ngram_candidates(context, min_n, min_n + extra_n, scan)


def test_chains_rank_over_the_deepest_chain_so_their_tokens_agree_at_every_depth():
    """Offered together, chain:2 is chain:6's first two tokens (goodput control pools chains by depth); alone, it
    ranks over its own two tokens."""
    # after "1": "5 4 4 4 4 4" twice, "5 9 .." three times diverging after "9": over 2 tokens "5 9" has more
    # support, over 6 tokens "5 4 4 4 4 4" has
    context = [1, 5, 4, 4, 4, 4, 4, 1, 5, 4, 4, 4, 4, 4, 1, 5, 9, 6, 6, 6, 6, 1, 5, 9, 7, 7, 7, 7, 1, 5, 9, 8, 8, 8, 8, 1]
    short, long = TreeShape.parse("lookup:chain:2"), TreeShape.parse("lookup:chain:6")

    def draft(shapes, shape):
        dev = NgramDeviceDrafter(shapes, min_ngram=1, max_ngram=1, candidates=8)
        dev.new_slots(1, 64)
        dev.prefill_slots([0], [context[:-1]])
        return dev.draft(shape, torch.tensor([1]), RowSampling.greedy(1, "cpu"), False).tokens[0].tolist()

    assert draft([short, long], long) == [1, 5, 4, 4, 4, 4, 4]
    assert draft([short, long], short) == [1, 5, 4]
    assert draft([short], short) == [1, 5, 9]


def test_history_follows_commits_plain_steps_and_idle_slots():
    """Drafts after device commits (random accepted paths), plain steps and a parked slot equal host drafts of the
    sequences the same tokens make."""
    rng = random.Random(7)
    shape = lookup_spec(3, 3)
    drafter = NgramDrafter(max_ngram=3, lookup_tree=shape)
    contexts = [[rng.randint(0, 3) for _ in range(n)] for n in (3, 9, 14)]
    dev, draft, _ = device_trees(drafter, shape, contexts)
    for step in range(12):
        roots = torch.tensor([c[-1] for c in contexts])
        if step % 3 == 2:  # a plain step: each slot takes a bonus token after its root
            dev.step_roots(roots)
            for c in contexts:
                c.append(rng.randint(0, 3))
        else:
            draft = dev.draft(shape, roots, RowSampling.greedy(3, "cpu"), False)
            paths, lengths = [], []
            for b, c in enumerate(contexts):
                valid = draft.valid[b].tolist()
                node, path = 0, [0]
                while True:  # walk down a random valid child, as a verifier might accept
                    kids = [i for i, p in enumerate(draft.parents[b].tolist()) if p == node and valid[i]]
                    if not kids or rng.random() < 0.3:
                        break
                    node = rng.choice(kids)
                    path.append(node)
                c.extend(draft.tokens[b, path[1:]].tolist() + [rng.randint(0, 3)])  # accepted nodes, then the bonus
                paths.append(path + [0] * (shape.max_depth + 1 - len(path)))
                lengths.append(len(path))
            dev.commit(torch.tensor(paths), torch.tensor(lengths))
        if step == 6:  # slot 1 leaves and a new sequence takes it
            dev.park(torch.tensor([False, True, False]))
            contexts[1] = [2, 2, 1]
            dev.prefill_slots([1], [contexts[1][:-1]])
        roots = torch.tensor([c[-1] for c in contexts])
        d = dev.draft(shape, roots, RowSampling.greedy(3, "cpu"), False)
        for b, got in enumerate(compact(d.tokens, d.parents, d.valid)):
            assert got == host_tree(drafter, shape, contexts[b])


# ----- retrieval ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pivots", [1, 2, 3, 31])
def test_suffix_ranges_equal_the_host_binary_search(pivots):
    rng = random.Random(pivots)
    for _ in range(6):
        docs = [[rng.randint(0, 3) for _ in range(rng.randint(0, 40))] for _ in range(rng.randint(1, 6))]
        store = Datastore.build(docs + [[0]], vocab_size=4)
        s = 5
        tail = torch.full((s,), -1)
        corpus = torch.cat([torch.as_tensor(store.tokens, dtype=torch.long), tail])
        sa = torch.as_tensor(store.suffix_array, dtype=torch.long)
        contexts = [[rng.randint(0, 3) for _ in range(s)] for _ in range(4)]
        queries = torch.tensor([[[c[s - 1 - m + j] if j <= m else 0 for j in range(s)] for m in range(s)]
                                for c in contexts])
        lower, upper = suffix_ranges(corpus, sa, queries, search_rounds(len(store), pivots), pivots)
        for b, c in enumerate(contexts):
            for m in range(s):
                assert (int(lower[b, m]), int(upper[b, m])) == store.find(c[s - 1 - m:])


@pytest.mark.parametrize("pivots", [1, 2, 5])
def test_search_rounds_settle_every_boundary(pivots):
    """The (P+1)-ary search on index sets: ``search_rounds(n)`` rounds find every boundary of every range size."""
    for n in range(0, 120):
        for boundary in range(n + 1):
            lo, hi = 0, n
            for _ in range(search_rounds(max(n, 1), pivots)):
                width = hi - lo
                if width == 0:
                    break
                pivot = [lo + (t * width) // (pivots + 1) for t in range(1, pivots + 1)]
                below = sum(p < boundary for p in pivot)
                lo, hi = (pivot[below - 1] + 1 if below else lo), (pivot[below] if below < pivots else hi)
            assert lo == hi == boundary, (n, boundary)


def test_sample_slots_takes_all_then_spreads():
    assert sample_slots(3, 7, 8) == [3, 4, 5, 6]
    assert sample_slots(0, 100, 5) == [0, 24, 49, 74, 99]
    assert sample_slots(10, 20, 1) == [10]


RETRIEVAL_CORPUS = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [7, 1, 2, 3, 9], [2, 2, 2, 2, 2, 2]]


@pytest.mark.parametrize("branches, depth", [(1, 3), (3, 2), (2, 5)])
def test_retrieval_device_equals_host_on_edge_cases(branches, depth):
    shape = lookup_spec(branches, depth)
    drafter = RetrievalDrafter(Datastore.build(RETRIEVAL_CORPUS, vocab_size=10), lookup_tree=shape)
    contexts = [[8], [8, 1, 2], [7, 1, 2], [3], [0, 2, 2], [4, 4, 4, 4, 4, 4, 4, 4]]
    _, _, got = device_trees(drafter, shape, contexts)
    for context, tree in zip(contexts, got):
        assert tree == host_tree(drafter, shape, context), context
    assert got[0] == ([8], [-1])  # no match


@settings(max_examples=50, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 3), max_size=20), min_size=1, max_size=6),
       contexts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), min_size=1, max_size=4),
       branches=st.integers(1, 3), depth=st.integers(1, 5), max_suffix=st.integers(1, 6), extra=st.integers(0, 5),
       pivots=st.sampled_from([1, 3, 31]))
def test_retrieval_device_equals_host(docs, contexts, branches, depth, max_suffix, extra, pivots):
    store = Datastore.build(docs + [[0, 1]], vocab_size=5)
    shape = lookup_spec(branches, depth)
    drafter = RetrievalDrafter(store, max_suffix=max_suffix, max_occurrences=branches + extra, lookup_tree=shape)
    dev = drafter.device_drafter().drafter
    dev.pivots, dev.rounds = pivots, search_rounds(len(store), pivots)
    _, _, got = device_trees(drafter, shape, contexts)
    for context, tree in zip(contexts, got):
        assert tree == host_tree(drafter, shape, context)


def test_lookup_shapes_are_checked():
    with pytest.raises(ValueError, match="lookup tree is chain:K or trie:DxW"):
        NgramDrafter(lookup_tree="beam:3x2")
    with pytest.raises(ValueError, match="3 branches need at least as many candidates"):
        NgramDrafter(max_scan=2, lookup_tree="trie:3x3").device_drafter()
    shapes = NgramDrafter().device_drafter().shapes
    assert shapes[0].kind == "none" and all(s.source == "lookup" for s in shapes[1:])
    assert TreeShape.parse("trie:2x2") not in shapes  # a layout is a lookup shape only with its source
    assert isinstance(NgramDrafter().open([1, 2, 1], GREEDY).draft(DraftBudget()), TokenTree)
