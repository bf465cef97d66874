"""Tree attention (split keys + merge) and KV compaction Triton kernels vs their references (CPU interpreter)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import padded_batch, rel_err  # noqa: E402
from stree.kernels.tree_attention import kv_commit_ref, tree_attention_ref  # noqa: E402
from stree.kernels.tree_attention_triton import (  # noqa: E402
    kv_commit_triton,
    tree_attention_sdpa,
    tree_attention_triton,
)
from stree.protocols.token_tree import ancestor_mask  # noqa: E402


def _case(gen, specs, hq, hkv, d, cache, seqlen):
    parents = padded_batch(specs, gen)
    b, n = parents.shape
    q = torch.randn(b, n, hq, d, generator=gen)
    k = torch.randn(b, cache, hkv, d, generator=gen)
    v = torch.randn(b, cache, hkv, d, generator=gen)
    return q, k, v, torch.tensor(seqlen), ancestor_mask(parents)


@pytest.mark.parametrize("splits,min_chunk", [(None, None), (1, None), (3, 16), (4, 0)])
def test_tree_attention_matches_reference(splits, min_chunk):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, seqlen, anc = _case(gen, [("bushy", 9), ("chain", 4)], 4, 2, 16, 80, [0, 60])
    ref = tree_attention_ref(q, k, v, seqlen, anc)
    out = torch.full_like(q, float("nan"))
    tree_attention_triton(q, k, v, seqlen, anc, out=out, num_splits=splits, min_chunk=min_chunk)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("nodes,block_m", [(1, None), (5, None), (5, 32), (9, 16)])
def test_few_rows_take_a_small_tile_and_still_match_the_reference(nodes, block_m):
    """A decode step (one node) and small trees: the 16-row tile by default (``block_rows``), or a forced one."""
    from stree.kernels.tree_attention_triton import block_rows

    assert block_rows(16, half=False) == 16 and block_rows(17, half=False) == 32 and block_rows(17, half=True) == 64
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, seqlen, anc = _case(gen, [("chain", nodes), ("bushy", nodes)], 4, 2, 16, 150, [0, 130])
    ref = tree_attention_ref(q, k, v, seqlen, anc)
    out = torch.full_like(q, float("nan"))
    tree_attention_triton(q, k, v, seqlen, anc, out=out, block_m=block_m)
    assert rel_err(out, ref) < 1e-5


def test_tree_attention_sdpa_variant_and_scale():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v, seqlen, anc = _case(gen, [("star", 6)], 3, 1, 8, 30, [11])
    ref = tree_attention_ref(q, k, v, seqlen, anc, softmax_scale=0.3)
    assert rel_err(tree_attention_triton(q, k, v, seqlen, anc, 0.3), ref) < 1e-5
    assert rel_err(tree_attention_sdpa(q, k, v, seqlen, anc, 0.3), ref) < 1e-5


def test_kv_commit_moves_accepted_rows_only():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, cache, hkv, d = 2, 30, 2, 8
    k = torch.randn(b, cache, hkv, d, generator=gen)
    v = torch.randn(b, cache, hkv, d, generator=gen)
    seqlen = torch.tensor([3, 10])
    path = torch.tensor([[0, 2, 5, 9, 0], [0, 1, 4, 0, 0]])
    path_len = torch.tensor([4, 3])
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    kv_commit_ref(k1, v1, seqlen, path, path_len)
    kv_commit_triton(k2, v2, seqlen, path, path_len)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)


def test_attention_rejects_mismatched_mask():
    q = torch.zeros(1, 4, 2, 8)
    kv = torch.zeros(1, 10, 2, 8)
    with pytest.raises(ValueError, match="anc_mask"):
        tree_attention_triton(q, kv, kv, torch.zeros(1, dtype=torch.long), torch.ones(1, 3, 3, dtype=torch.bool))
