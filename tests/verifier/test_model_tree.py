"""Tree forward and commit against sequential decoding, on pure Mamba2 and hybrid models, random trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree import TokenTree, TreeBatch
from stree.verifier.model.attention import AttnLayerState
from stree.verifier.model.mamba2_mixer import MambaLayerState

from tree_strategies import token_trees

ATOL = 2e-5
ARCHS = ["mamba2", "hybrid"]


def _prefix(seed: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@given(tree=token_trees(vocab_size=64, max_nodes=20), plen=st.integers(0, 12), seed=st.integers(0, 10**6))
@settings(max_examples=15, deadline=None)
def test_score_tree_equals_sequential_scoring(models, arch, tree, plen, seed):
    model = models[arch]
    prefix = _prefix(seed, plen, model.vocab_size)
    got = model.score_tree(prefix, tree)
    assert got.shape == (tree.num_nodes, model.vocab_size)
    for i in range(tree.num_nodes):
        seq = torch.cat([prefix, torch.tensor(tree.path_tokens(i))])
        want = model.score_sequence(seq)[-1]
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_trees_of_different_sizes_match_single_trees(models, arch):
    model = models[arch]
    g = torch.Generator().manual_seed(0)
    trees = [
        TokenTree.from_parents(torch.randint(0, 64, (n,), generator=g), [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
        for n in (1, 5, 11)
    ]
    prefixes = [_prefix(s, 4 + 3 * s, 64) for s in range(3)]
    states = []
    for p in prefixes:  # prefill each row separately into one batched state
        s = model.new_state(1, 64)
        model.prefill(p[None], s)
        states.append(s)
    batch_state = model.new_state(3, 64)
    for row, s in enumerate(states):
        for dst, src in zip(batch_state.layers, s.layers):
            for name in vars(dst):
                getattr(dst, name)[row] = getattr(src, name)[0]
        batch_state.seqlen[row] = s.seqlen[0]
    logits, _ = model.tree_forward(TreeBatch.from_trees(trees), batch_state)
    for row, (tree, p) in enumerate(zip(trees, prefixes)):
        torch.testing.assert_close(logits[row, : tree.num_nodes], model.score_tree(p, tree), atol=ATOL, rtol=1e-4)


def _states_close(a, b, seqlen: int):
    for la, lb in zip(a.layers, b.layers):
        if isinstance(la, MambaLayerState):
            torch.testing.assert_close(la.ssm_state, lb.ssm_state, atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(la.conv_state, lb.conv_state, atol=ATOL, rtol=1e-4)
        else:
            assert isinstance(la, AttnLayerState)
            torch.testing.assert_close(la.k_cache[:, :seqlen], lb.k_cache[:, :seqlen], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(la.v_cache[:, :seqlen], lb.v_cache[:, :seqlen], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@given(tree=token_trees(vocab_size=64, max_nodes=16), plen=st.integers(1, 10), seed=st.integers(0, 10**6),
       pick=st.integers(0, 10**6))
@settings(max_examples=15, deadline=None)
def test_commit_equals_feeding_the_path(models, arch, tree, plen, seed, pick):
    model = models[arch]
    prefix = _prefix(seed, plen, model.vocab_size)
    node = pick % tree.num_nodes
    path = tree.path(node)

    state = model.new_state(1, 48)
    model.prefill(prefix[None], state)
    _, acts = model.tree_forward(TreeBatch.from_trees([tree]), state)
    model.commit(state, acts, torch.tensor([path]), torch.tensor([len(path)]))

    ref = model.new_state(1, 48)
    model.prefill(prefix[None], ref)
    for tok in tree.path_tokens(node):
        model.step(torch.tensor([tok]), ref)

    assert int(state.seqlen[0]) == int(ref.seqlen[0]) == plen + len(path)
    _states_close(state, ref, plen + len(path))
    nxt = torch.tensor([seed % model.vocab_size])
    torch.testing.assert_close(model.step(nxt, state), model.step(nxt, ref), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_step_and_forward_agree(models, arch):
    model = models[arch]
    ids = _prefix(7, 150, model.vocab_size)  # longer than one SSD chunk (64)
    full = model(ids[None])[0]
    torch.testing.assert_close(model.score_sequence(ids), full, atol=ATOL, rtol=1e-4)
    state = model.new_state(1, 200)
    steps = torch.stack([model.step(ids[t : t + 1], state)[0] for t in range(40)])
    torch.testing.assert_close(steps, full[:40], atol=ATOL, rtol=1e-4)
    # prefill continuing from a state equals one long prefill
    state = model.new_state(1, 200)
    model.prefill(ids[None, :70], state)
    tail = model.prefill(ids[None, 70:], state)[0]
    torch.testing.assert_close(tail, full[70:], atol=ATOL, rtol=1e-4)


def test_tree_forward_leaves_state_untouched(models):
    model = models["hybrid"]
    state = model.new_state(1, 40)
    model.prefill(_prefix(1, 6, 64)[None], state)
    before = state.clone()
    model.tree_forward(TreeBatch.from_trees([TokenTree.from_parents([1, 2, 3], [-1, 0, 0])]), state)
    _states_close(state, before, 6)
    assert int(state.seqlen[0]) == 6


def test_score_tree_rejects_tokens_outside_vocab(models):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        models["mamba2"].score_tree(torch.tensor([1, 2]), TokenTree.from_parents([1, 99], [-1, 0]))
