"""The one-launch sampled verification kernel equals its reference (``sampled_verify_ref`` in float32) on random
padded tree batches: every draft mode, greedy and sampled rows mixed, trees that accept deep, a vocabulary over
several blocks; a kernel biased on purpose does not."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

pytest.importorskip("triton")

from kernel_trees import verify_case
from stree.kernels import ops
from stree.kernels.greedy_verify_triton import MAX_NODES
from stree.kernels.sampled_verify import sampled_verify_ref
from stree.kernels.sampled_verify_triton import sampled_verify_triton
from stree.protocols.token_tree import DraftMode

MODES = list(DraftMode)
NAMES = ("path", "path_len", "bonus", "out_tokens")


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_sampled_kernel_matches_reference_on_random_trees(mode):
    accepted = 0
    for seed in range(40):
        args = verify_case(seed, mode, vocab=[5, 37, 300][seed % 3])
        got = sampled_verify_triton(*args)
        want = sampled_verify_ref(*args)
        for g, w, name in zip(got, want, NAMES):
            assert torch.equal(g, w), (seed, name, g, w)
        accepted += int((want[1] - 1).sum())
    assert accepted > 40, "the trees should accept drafted tokens often"


def test_sampled_kernel_blocks_over_a_large_vocabulary():
    """A vocabulary over one block (several loop iterations per pass, a partial last block)."""
    for seed in range(3):
        args = verify_case(100 + seed, MODES[seed], vocab=9000, follow=0.8)
        got, want = sampled_verify_triton(*args), sampled_verify_ref(*args)
        for g, w, name in zip(got, want, NAMES):
            assert torch.equal(g, w), (seed, name, g, w)


def _filters(args, seed):
    """Per-row top-k (0: off) and top-p (1: off) for a ``verify_case``, each on in about half the rows."""
    gen = torch.Generator().manual_seed(seed)
    b, vocab = args[3].shape[0], args[3].shape[2]
    top_k = torch.randint(1, vocab + 1, (b,), generator=gen) * (torch.rand(b, generator=gen) < 0.5)
    top_p = torch.where(torch.rand(b, generator=gen) < 0.5, 0.2 + 0.75 * torch.rand(b, generator=gen), 1.0)
    return top_k, top_p


def test_ops_routes_float64_and_large_trees_to_the_reference_and_filters_to_the_kernel(monkeypatch):
    from stree.kernels import backend

    args = list(verify_case(7, DraftMode.IID, vocab=11))
    calls = []
    monkeypatch.setattr("stree.kernels.sampled_verify_triton.sampled_verify_triton",
                        lambda *a, **k: calls.append(a[5:7]) or sampled_verify_ref(*a, **k))
    backend.use("triton")
    ops._CACHE.clear()
    try:
        ops.sampled_verify(*args)
        assert calls == [(None, None)]
        top_k, top_p = _filters(args, 0)
        ops.sampled_verify(*args[:5], top_k, top_p, *args[7:])  # filters: the kernel, on filtered logits
        assert calls[-1] == (None, None) and len(calls) == 2
        ops.sampled_verify(*args, prob_dtype=torch.float64)
        assert len(calls) == 2
    finally:
        backend.use(None)
        ops._CACHE.clear()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_filtered_rows_through_the_kernel_match_the_reference(mode):
    """Top-k / top-p rows: the kernel on ``filter_logits_rows``' logits draws what the reference draws with the
    filters, given the same uniforms."""
    from stree.protocols.sampling import filter_logits_rows

    filtered_rows = 0
    for seed in range(30):
        args = list(verify_case(200 + seed, mode, vocab=[5, 37, 300][seed % 3]))
        top_k, top_p = _filters(args, seed)
        want = sampled_verify_ref(*args[:5], top_k, top_p, *args[7:])
        logits = filter_logits_rows(args[3], args[4], top_k, top_p)
        got = sampled_verify_triton(*args[:3], logits, *args[4:])
        for g, w, name in zip(got, want, NAMES):
            assert torch.equal(g, w), (seed, name, g, w)
        filtered_rows += int(((top_k > 0) | (top_p < 1)).sum())
    assert filtered_rows > 30


def test_sampled_kernel_refuses_what_it_cannot_do():
    args = list(verify_case(3, DraftMode.IID, vocab=7))
    with pytest.raises(ValueError, match="filtered logits"):
        sampled_verify_triton(*args[:5], torch.zeros(args[0].shape[0], dtype=torch.long), *args[6:])
    with pytest.raises(ValueError, match="float32"):
        sampled_verify_triton(*args, prob_dtype=torch.float64)
    z = torch.zeros(1, MAX_NODES + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="one-program limit"):
        sampled_verify_triton(z, z, z.bool(), torch.zeros(1, MAX_NODES + 1, 3), torch.ones(1), None, None,
                              DraftMode.DETERMINISTIC, None, z.float(), z.float(), 2, 2)


# ----- the law -------------------------------------------------------------------------------------------------
# The kernel equals the reference, which passes the chi-square law tests (tests/verifier/test_verify_device.py);
# the kernel's own law tests run on the GPU (tests/gpu/test_sampled_verify_gpu.py: thousands of rows, one launch).
# Here: a kernel biased on purpose no longer equals the reference, so the test above would catch it.
@pytest.mark.parametrize("bias, mode", [({"accept_scale": 1.5}, DraftMode.IID),
                                        ({"accept_scale": 1.5}, DraftMode.DETERMINISTIC),
                                        ({"remove": False}, DraftMode.WITHOUT_REPLACEMENT)],
                         ids=["accept-iid", "accept-point-mass", "no-removal"])
def test_a_biased_kernel_differs_from_the_reference(bias, mode):
    """64 stars of three children over a 3-token vocabulary: rejections followed by further tries are common."""
    gen = torch.Generator().manual_seed(5)
    b, n, vocab = 64, 4, 3
    parents = torch.tensor([-1, 0, 0, 0]).expand(b, n).contiguous()
    tokens = torch.randint(0, vocab, (b, n), generator=gen)
    q = (torch.rand(b, n, vocab, generator=gen) + 0.5) if mode is not DraftMode.DETERMINISTIC else None
    args = (tokens, parents, torch.ones(b, n, dtype=torch.bool), torch.randn(b, n, vocab, generator=gen),
            torch.ones(b), None, None, mode, q, torch.rand(b, n, generator=gen), torch.rand(b, n, generator=gen), 1, 3)
    got, want = sampled_verify_triton(*args, **bias), sampled_verify_ref(*args)
    assert torch.equal(sampled_verify_triton(*args)[2], want[2])  # unbiased: the same draws
    assert not torch.equal(got[2], want[2]) or not torch.equal(got[1], want[1])
