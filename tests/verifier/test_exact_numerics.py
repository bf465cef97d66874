"""Exact numerics at the model and engine level (CPU, fp32): a tree node's logits are bit for bit what decode steps
along its path give, whatever the tree and the batch; the commit leaves exactly the steps' state; a prompt's prefill
and a request's tokens do not depend on what shares its batch. On the PyTorch references, and once on the Triton
kernels (interpreter). A model whose GEMM rounds by the row count fails the same check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import stree
from stree import TokenTree, TreeBatch
from stree.kernels import backend, gemm, numerics, ops
from tree_strategies import token_trees


def _prefilled(model, prefix: torch.Tensor, room: int = 64):
    state = model.new_state(1, prefix.numel() + room)
    if prefix.numel():
        model.prefill(prefix[None], state)
    return state


def _stack_rows(model, states, room: int):
    """One batched state whose row b is ``states[b]`` (batch 1 each)."""
    batch = model.new_state(len(states), room)
    for row, s in enumerate(states):
        batch.assign_rows([row], s)
    return batch


def _same_state(a, b, upto: int) -> bool:
    for la, lb in zip(a.layers, b.layers):
        for name, t in vars(la).items():
            u = getattr(lb, name)
            if name.endswith("_cache"):
                t, u = t[:, :upto], u[:, :upto]
            if not torch.equal(t, u):
                return False
    return torch.equal(a.seqlen, b.seqlen)


def _tree_failures(model, tree: TokenTree, prefix: torch.Tensor, other: TokenTree, commit_to: int) -> int:
    """Nodes of ``tree`` (row 0 of a batch with ``other`` after another prefix) whose logits differ from decode
    steps along their path, plus one if committing the path to ``commit_to`` leaves another state than its steps."""
    room = 64
    states = [_prefilled(model, prefix, room), _prefilled(model, prefix[:3].flip(0), room)]
    batch = _stack_rows(model, states, prefix.numel() + room)
    logits, acts = model.tree_forward(TreeBatch.from_trees([tree, other]), batch)
    bad = 0
    for node in range(tree.num_nodes):
        state = states[0].clone()
        for tok in tree.path_tokens(node):
            step = model.step(torch.tensor([tok]), state)
        bad += not torch.equal(step[0], logits[0, node])
    path = tree.path(commit_to)
    other_path = other.path(other.num_nodes - 1)
    width = max(len(path), len(other_path))
    model.commit(batch, acts, torch.tensor([path + [0] * (width - len(path)), other_path + [0] * (width - len(other_path))]),
                 torch.tensor([len(path), len(other_path)]))
    stepped = states[0].clone()
    for tok in tree.path_tokens(commit_to):
        model.step(torch.tensor([tok]), stepped)
    mine = batch.rows(1, 0)
    bad += not _same_state(mine, stepped, int(stepped.seqlen[0]))
    return bad


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@given(tree=token_trees(vocab_size=64, max_nodes=12), other=token_trees(vocab_size=64, max_nodes=9),
       plen=st.integers(3, 10), end=st.integers(0, 11), seed=st.integers(0, 10**6))
@settings(max_examples=8, deadline=None)
def test_tree_logits_and_commit_equal_decode_steps_bit_for_bit(models, arch, tree, other, plen, end, seed):
    model = models[arch]
    prefix = torch.randint(0, model.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed))
    assert _tree_failures(model, tree, prefix, other, end % tree.num_nodes) == 0


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_triton_kernels_keep_tree_logits_equal_to_decode_steps(models, arch):
    """The same property on the Triton kernels (CPU interpreter): GEMM, step, tree walk, replay, attention."""
    g = torch.Generator().manual_seed(1)
    tree = TokenTree.from_parents(torch.randint(0, 64, (6,), generator=g), [-1, 0, 0, 1, 3, 2])
    other = TokenTree.from_parents(torch.randint(0, 64, (3,), generator=g), [-1, 0, 1])
    backend.use("triton")
    try:
        assert _tree_failures(models[arch], tree, torch.randint(0, 64, (5,), generator=g), other, 4) == 0
    finally:
        backend.use(None)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_prefill_state_does_not_depend_on_the_batch_or_padding(models, arch):
    """Each prompt prefilled alone equals its row of a right-padded batch of others, and an unpadded prefill."""
    model = models[arch]
    g = torch.Generator().manual_seed(2)
    lengths = [9, 3, 14]
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    width = 16
    ids = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, : p.numel()] = p
    batch = model.new_state(3, 32)
    h_batch = model.prefill_padded(ids, torch.tensor(lengths), batch, return_hidden=True)[1]
    for row, p in enumerate(prompts):
        alone = model.new_state(1, 32)
        h_alone = model.prefill_padded(p[None], torch.tensor([p.numel()]), alone, return_hidden=True)[1]
        assert torch.equal(h_alone[0], h_batch[row])
        assert _same_state(alone, batch.rows(1, row), p.numel())
        assert _same_state(_prefilled(model, p, 32 - p.numel()), alone, p.numel())


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_request_alone_equals_the_same_request_in_a_batch(models, arch):
    model, draft = models[arch], models["draft"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (7,), generator=g)]
    for drafter, opts in ((None, {}), ("mamba", {"draft_model": draft, "tree": "beam:3x2"})):
        alone = stree.generate(model, prompts[2], drafter=drafter, max_new_tokens=12, **opts).token_ids
        together = stree.generate(model, prompts, drafter=drafter, max_new_tokens=12, **opts)
        assert together[2].token_ids == alone, drafter
    plain = stree.generate(model, prompts[2], max_new_tokens=12).token_ids
    assert alone == plain


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_a_seeded_sampled_request_alone_equals_the_same_request_in_a_batch(models, arch):
    """At T > 0 a request's draws are keyed by its own seed and steps: alone, or third among six others of their own
    seeds, it gives the same tokens, plain and speculative (a fixed tree). Another seed gives other tokens, so the
    check can fail."""
    model, draft = models[arch], models["draft"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (7,), generator=g)]
    seeds = [int(s) for s in torch.randint(0, 2**40, (7,), generator=g)]
    sampling = dict(temperature=1.3, top_p=0.95, max_new_tokens=16)
    for drafter, opts in ((None, {}), ("mamba", {"draft_model": draft, "tree": "beam:3x2"}),
                          ("mamba", {"draft_model": draft, "tree": "chain:3"})):
        alone = stree.generate(model, prompts[2], drafter=drafter, seed=[seeds[2]], **sampling, **opts).token_ids
        together = stree.generate(model, prompts, drafter=drafter, seed=seeds, **sampling, **opts)
        assert together[2].token_ids == alone, (drafter, opts)
        other = stree.generate(model, prompts[2], drafter=drafter, seed=[seeds[2] + 1], **sampling, **opts)
        assert other.token_ids != alone, (drafter, opts)


def test_a_gemm_rounding_by_row_count_breaks_the_check(models, monkeypatch):
    """Plant F.linear on the raw row count (a library GEMM: one row and many take different kernels) as the exact
    GEMM: some tree node's logits then differ from its decode steps."""
    monkeypatch.setattr(gemm, "gemm_ref", lambda x, w, b=None: F.linear(x, w, b))
    monkeypatch.setattr(ops, "_CACHE", {})
    model = models["mamba2"]
    g = torch.Generator().manual_seed(4)
    bad = 0
    for _ in range(4):
        tree = TokenTree.from_parents(torch.randint(0, 64, (12,), generator=g), [-1] + list(range(11)))
        bad += _tree_failures(model, tree, torch.randint(0, 64, (6,), generator=g), tree, 11)
    assert bad > 0


def test_fast_numerics_is_close_but_runs_other_kernels(models):
    """``STREE_NUMERICS=fast`` keeps the per-shape kernels (here: the chunked tree scan and closed-form commit):
    tree logits close to the decode steps', generation as plain greedy on this fp32 model."""
    numerics.use("fast")
    try:
        model = models["hybrid"]
        tree = TokenTree.from_parents(list(range(5)), [-1, 0, 0, 1, 3])
        prefix = torch.arange(4)
        got = model.score_tree(prefix, tree)
        for node in range(5):
            want = model.score_sequence(torch.cat([prefix, torch.tensor(tree.path_tokens(node))]))[-1]
            torch.testing.assert_close(got[node], want, atol=2e-5, rtol=1e-4)
    finally:
        numerics.use(None)
