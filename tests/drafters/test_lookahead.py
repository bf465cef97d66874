"""Drafting ahead, in-process: the hypotheses ``Lookahead`` drafts about a tree, the rule that decides when one is
worth drafting, and the forks of n-gram and mamba sessions they are drafted on (a fork that commits a path in parts
ends where a session that commits it at once does, bit for bit, and leaves the session it came from as it was)."""

from __future__ import annotations

import random

import pytest
import torch

from stree import DraftBudget, SamplingParams
from stree.drafter_service.drafters.mamba.drafter import MambaDrafter
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.lookahead import Lookahead, children_of_root, leaf_paths
from stree.drafter_service.lookahead_control import LookaheadControl
from stree.protocols.drafter import ForkableSession
from stree.protocols.token_tree import TokenTree

BUDGET = DraftBudget(max_nodes=16, max_depth=4, max_width=3)


def _tree(tokens, parents) -> TokenTree:
    return TokenTree(tokens, parents)


@pytest.mark.parametrize("tokens, parents, want", [
    ([7], [-1], [[]]),  # root only: the next token alone is the hypothesis
    ([7, 1, 2, 3], [-1, 0, 1, 2], [[1, 2, 3]]),  # a chain: one leaf
    # root -> 1 -> (2 -> 4), 3 ; root -> 5: leaves 4 (depth 3), 3 (depth 2), 5 (depth 1)
    ([7, 1, 2, 3, 4, 5], [-1, 0, 1, 1, 2, 0], [[1, 2, 4], [1, 3], [5]]),
    # equal depths keep node order (a beam tree lists its best beam first)
    ([7, 8, 9, 10, 11], [-1, 0, 0, 1, 2], [[8, 10], [9, 11]]),
])
def test_leaf_paths_deepest_first(tokens, parents, want):
    assert leaf_paths(_tree(tokens, parents)) == want


def test_leaf_paths_cover_every_leaf_of_random_trees():
    rng = random.Random(torch.initial_seed())
    for _ in range(20):
        n = rng.randint(1, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tokens = [rng.randrange(64) for _ in range(n)]
        tree = _tree(tokens, parents)
        leaves = [i for i in range(n) if i not in parents[1:]]
        paths = leaf_paths(tree)
        assert sorted(map(tuple, paths)) == sorted(tuple(tree.path_tokens(i)[1:]) for i in leaves)
        assert [len(p) for p in paths] == sorted((len(p) for p in paths), reverse=True)


def _mamba(model, shape="chain:4") -> MambaDrafter:
    return MambaDrafter(model, shape)


def _state_tensors(session) -> list[torch.Tensor]:
    return [t.clone() for t in session.state.tensors()]


def _same_tree(a: TokenTree, b: TokenTree) -> bool:
    same = a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    if a.draft_probs is None or b.draft_probs is None:
        return same and a.draft_probs is None and b.draft_probs is None
    return same and torch.equal(a.draft_probs, b.draft_probs)


def test_lookahead_drafts_each_leaf_with_its_guesses_and_take_keeps_the_hit(models):
    drafter = _mamba(models["draft"], "beam:3x2")
    prompt = [5, 9, 13, 2, 7]
    session = drafter.open(prompt, SamplingParams())
    tree = session.draft(BUDGET)
    before = _state_tensors(session)
    ahead = Lookahead(session, tree, BUDGET, limit=3, width=2)
    drafted = []
    while (h := ahead.next()) is not None:
        drafted.append(h)
    assert len(drafted) == 3  # the limit
    paths = leaf_paths(tree)
    # hypotheses: the deepest leaf's path with its two likeliest next tokens, then the next leaf's path
    assert [h.tokens[:-1] for h in drafted] == [tuple(paths[0])] * 2 + [tuple(paths[1])]
    probe = drafter.open(prompt, SamplingParams())
    probe.commit(paths[0])
    guesses = children_of_root(probe.draft(DraftBudget(max_nodes=3, max_depth=1, max_width=2)))
    assert [h.tokens[-1] for h in drafted[:2]] == guesses
    for h in drafted:  # each fork committed its hypothesis and drafted what a fresh session drafts there
        fresh = drafter.open(prompt, SamplingParams())
        fresh.commit(list(h.tokens))
        assert h.session.context == prompt + list(h.tokens)
        assert _same_tree(h.tree, fresh.draft(BUDGET))
    assert all(torch.equal(a, b) for a, b in zip(before, session.state.tensors()))  # the session did not move
    assert session.context == prompt
    hit = ahead.take(drafted[1].tokens)
    assert hit is drafted[1] and hit.session.state is not None
    assert drafted[0].session.state is None and drafted[2].session.state is None  # the other forks are closed
    assert ahead.next() is None and ahead.take(drafted[0].tokens) is None


def test_lookahead_miss_and_close_free_every_fork(models):
    drafter = _mamba(models["draft"], "beam:3x2")
    session = drafter.open([1, 2, 3, 4], SamplingParams())
    ahead = Lookahead(session, session.draft(BUDGET), BUDGET, limit=4)
    drafted = [ahead.next(), ahead.next()]
    assert all(h is not None for h in drafted)
    assert ahead.take([63, 62, 61]) is None  # a commit no hypothesis assumed
    assert all(h.session.state is None for h in drafted) and ahead.probe is None
    again = Lookahead(session, session.draft(BUDGET), BUDGET, limit=4)
    h = again.next()
    again.close()
    assert h.session.state is None and again.next() is None
    assert session.state is not None  # the session itself stays open


def test_root_only_tree_guesses_the_next_token(models):
    drafter = _mamba(models["draft"], "beam:3x2")  # a chain drafter would guess one token only
    session = drafter.open([3, 1, 4], SamplingParams())
    root_only = session.root_only()
    ahead = Lookahead(session, root_only, BUDGET, limit=2, width=2)
    hs = [ahead.next(), ahead.next(), ahead.next()]
    assert hs[2] is None and all(len(h.tokens) == 1 for h in hs[:2])
    ahead.close()


@pytest.mark.parametrize("model_name, shape", [("draft", "chain:4"), ("draft", "beam:3x2"), ("hybrid", "chain:3")])
def test_mamba_fork_committing_in_parts_equals_committing_at_once(models, model_name, shape):
    drafter = _mamba(models[model_name], shape)
    rng = random.Random(torch.initial_seed())
    prompt = [rng.randrange(64) for _ in range(rng.randint(1, 9))]
    tokens = [rng.randrange(64) for _ in range(rng.randint(2, 7))]
    cut = rng.randint(1, len(tokens) - 1)
    session = drafter.open(prompt, SamplingParams())
    assert isinstance(session, ForkableSession)
    before, first_tree = _state_tensors(session), session.draft(BUDGET)
    fork = session.fork()
    fork.commit(tokens[:cut])
    fork.commit(tokens[cut:])
    fresh = drafter.open(prompt, SamplingParams())
    fresh.commit(tokens)
    assert fork.context == fresh.context == prompt + tokens
    assert all(torch.equal(a, b) for a, b in zip(fork.state.tensors(), fresh.state.tensors()))
    assert _same_tree(fork.draft(BUDGET), fresh.draft(BUDGET))
    # the original is where it was: same context, same state, same tree
    assert session.context == prompt
    assert all(torch.equal(a, b) for a, b in zip(before, session.state.tensors()))
    assert _same_tree(session.draft(BUDGET), first_tree)
    fork.close()
    assert session.state is not None and _same_tree(session.draft(BUDGET), first_tree)


def test_mamba_fork_copies_the_random_generator(models):
    drafter = _mamba(models["draft"], "chain:4")
    session = drafter.open([2, 7, 1, 8], SamplingParams(temperature=1.0, seed=11))
    fork = session.fork()
    a, b = session.draft(BUDGET), fork.draft(BUDGET)
    assert _same_tree(a, b) and a.draft_probs is not None  # the same draw: the generator was copied
    assert _same_tree(session.draft(BUDGET), fork.draft(BUDGET))  # and each advances its own


def test_ngram_fork_committing_in_parts_equals_committing_at_once():
    drafter = NgramDrafter()
    rng = random.Random(torch.initial_seed())
    text = [rng.randrange(6) for _ in range(40)]
    prompt, tokens = text[:30], text[30:]
    session = drafter.open(prompt, SamplingParams())
    index_before = {n: {g: list(e) for g, e in t.items()} for n, t in session._index.items()}
    tree_before = session.draft(BUDGET)
    fork = session.fork()
    fork.commit(tokens[:3])
    fork.commit(tokens[3:7])
    fork.commit(tokens[7:])
    fresh = drafter.open(prompt, SamplingParams())
    fresh.commit(tokens)
    assert fork.context == fresh.context and fork._index == fresh._index
    assert _same_tree(fork.draft(BUDGET), fresh.draft(BUDGET))
    assert session.context == prompt and session._index == index_before
    assert _same_tree(session.draft(BUDGET), tree_before)


def test_control_tries_only_the_likeliest_before_measuring():
    control = LookaheadControl()
    assert control.worth(0, 10.0) and not control.worth(1, 0.0)
    control.observed(0.010, tried=0, hit_rank=None)
    assert not control.worth(1, 0.0)  # no draft time measured yet
    control.drafted_fresh(0.004)
    assert control.worth(1, 0.0)  # cost (the draft time) fits the window


def test_control_weighs_a_late_hypothesis_by_its_hit_rate():
    control = LookaheadControl()
    control.observed(0.010, tried=0, hit_rank=None)  # window 10 ms
    control.drafted_fresh(0.004)  # a commit-and-draft: 4 ms
    control.drafted(0, 0.003)  # rank 0 took 3 ms; rank 1 has not been drafted: it costs what rank 0 did
    assert control.worth(1, 0.006)  # 6 + 3 <= 10: done within the window
    # 9 + 3 - 10 = 2 ms over; p(1) = 1/2 unmeasured: 0.5 * 4 > 0.5 * 2
    assert control.worth(1, 0.009)
    # 7 ms over: 0.5 * 4 < 0.5 * 7
    assert not control.worth(1, 0.014)
    for _ in range(8):  # rank 1 came true every time it was tried: p = 9/10
        control.observed(0.010, tried=2, hit_rank=1)
    assert control.p_hit(1) == pytest.approx(9 / 10) and control.p_hit(0) == pytest.approx(1 / 10)
    assert control.worth(1, 0.014)  # 0.9 * 4 > 0.1 * 7
    assert not control.worth(0, 0.014)  # rank 0 never comes true: 0.1 * 4 < 0.9 * 7
