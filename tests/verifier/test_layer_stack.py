"""Stacked layer states: one ``[L, ...]`` tensor per field, whole-model work in one launch, same results."""

from __future__ import annotations

import pytest
import torch
from stree.drafter_service.drafters.mamba.beam_search import _reorder_rows_, copy_state_
from stree.kernels import backend
from stree.verifier.model.layer_stack import field_stacks, stacked_view
from stree.verifier.model.lm import LMState, _map_layer

from stree import TokenTree, TreeBatch
from stree.bench.launches import count_launches


def _unstacked(state: LMState) -> LMState:
    """The same state with every layer's tensors cloned on their own: the per-layer paths run on it."""
    return LMState([_map_layer(s, torch.clone) for s in state.layers], state.seqlen.clone(), state.max_seqlen)


def _filled(model, batch: int) -> LMState:
    state = model.new_state(batch, 32)
    for layer in state.layers:
        for t in vars(layer).values():
            t.normal_()
    state.seqlen.copy_(torch.randint(0, 8, (batch,)))
    return state


def _assert_same(a: LMState, b: LMState) -> None:
    for la, lb in zip(a.layers, b.layers):
        for name, t in vars(la).items():
            torch.testing.assert_close(t, getattr(lb, name), atol=1e-5, rtol=1e-5)
    assert torch.equal(a.seqlen, b.seqlen)


def _stacked_fields(state: LMState) -> dict:
    return {name: view is not None for name, _, view in field_stacks(state.layers)}


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_new_state_stacks_the_mamba_layers_and_views_keep_it(models, arch):
    state = _filled(models[arch], 4)
    assert _stacked_fields(state)["ssm_state"] and _stacked_fields(state)["conv_state"]
    rows = state.rows(2, start=1)
    assert _stacked_fields(rows)["ssm_state"]
    picked = state.select(torch.tensor([3, 0, 0]))
    assert _stacked_fields(picked)["ssm_state"] and _stacked_fields(state.clone())["conv_state"]
    for la, lp in zip(state.layers, picked.layers):
        for name, t in vars(la).items():
            assert torch.equal(getattr(lp, name), t[[3, 0, 0]])
    assert not _stacked_fields(_unstacked(state))["ssm_state"]


def test_stacked_view_refuses_what_is_not_one_equally_spaced_stack():
    base = torch.randn(4, 3, 5)
    assert torch.equal(stacked_view([base[i] for i in range(4)]), base)
    assert stacked_view([base[0], base[2], base[1]]) is None  # out of order
    assert stacked_view([base[0], base[1], base[3]]) is None  # unequal spacing
    assert stacked_view([base[0].clone(), base[1].clone()]) is None  # separate storages
    flat = torch.randn(40)
    overlapping = [flat[i * 5: i * 5 + 10].view(2, 5) for i in range(3)]  # each reaches into the next
    assert stacked_view(overlapping) is None
    assert stacked_view([base[0, :2], base[1, :2]]).shape == (2, 2, 5)  # row slices of a stack stay one


@pytest.mark.parametrize("arch,kernels", [("mamba2", "torch"), ("mamba2", "triton"), ("hybrid", "triton")])
def test_commit_replays_every_mamba_layer_in_one_launch(models, arch, kernels):
    """The stacked commit equals the per-layer commit, with one replay launch for the whole model."""
    model = models[arch]
    state = _filled(model, 3)
    state.seqlen.fill_(4)
    other = _unstacked(state)
    trees = TreeBatch.from_trees([TokenTree([1, 2, 3, 4], [-1, 0, 0, 2]), TokenTree([5, 6], [-1, 0]),
                                  TokenTree([7, 8, 9], [-1, 0, 1])])
    path = torch.tensor([[0, 2, 3], [0, 1, 0], [0, 0, 0]])
    path_len = torch.tensor([3, 2, 1])
    backend.use(kernels)
    try:
        logits, acts = model.tree_forward(trees, state)
        with count_launches() as counted:
            model.commit(state, acts, path, path_len)
        other_logits, other_acts = model.tree_forward(trees, other)
        with count_launches() as counted_other:
            model.commit(other, other_acts, path, path_len)
    finally:
        backend.use(None)
    torch.testing.assert_close(logits, other_logits, atol=1e-5, rtol=1e-5)
    _assert_same(state, other)
    mamba_layers = sum(b.kind == "mamba" for b in model.backbone.layers)
    if kernels == "triton":
        assert counted["triton._replay_kernel"] == 1
        assert counted_other["triton._replay_kernel"] == mamba_layers


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_row_copies_on_stacked_fields_equal_per_layer_copies(models, arch):
    """Admission's ``assign_rows``, a beam's row reorder and ``copy_state_`` give what per-layer copies give."""
    model = models[arch]
    src = _filled(model, 2)
    dst, dst_plain = _filled(model, 5), None
    dst_plain = _unstacked(dst)
    dst.assign_rows([4, 1], src)
    dst_plain.assign_rows([4, 1], _unstacked(src))
    _assert_same(dst, dst_plain)

    rows = torch.tensor([2, 2, 0, 4, 1])
    _reorder_rows_(dst, rows)
    _reorder_rows_(dst_plain, rows)
    _assert_same(dst, dst_plain)

    one = _filled(model, 1)
    copy_state_(dst, one)
    copy_state_(dst_plain, _unstacked(one))
    _assert_same(dst, dst_plain)
    assert _stacked_fields(dst)["ssm_state"]  # the stack survives in-place work
