"""The exact numerics' tree attention (``tree_attention_exact_ref``; ``tree_attention_exact_triton`` on the CPU
interpreter, fp32): close to the masked-softmax reference, and a tree node's output is bit for bit a decode step's
at its position (its committed keys, then its ancestors, contiguous in a cache of any size), whatever the tree,
the batch, the split over keys and the number of programs sharing it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import KINDS, padded_batch, rel_err  # noqa: E402
from stree.kernels import tree_attention_exact_triton as exact_triton  # noqa: E402
from stree.kernels.tree_attention import tree_attention_ref  # noqa: E402
from stree.kernels.tree_attention_exact import ancestor_slots, tree_attention_exact_ref  # noqa: E402
from stree.protocols.token_tree import ancestor_mask  # noqa: E402

HQ, HKV, D = 4, 2, 16
IMPLS = {"torch": tree_attention_exact_ref, "triton": exact_triton.tree_attention_exact_triton}


def _case(gen, cache=48):
    specs = [(KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))], int(torch.randint(1, 8, (1,),
                                                                                                  generator=gen)))
             for _ in range(2)]
    parents = padded_batch(specs, gen)
    b, n = parents.shape
    seqlen = torch.randint(0, cache - n, (b,), generator=gen)
    return (parents, torch.randn(b, n, HQ, D, generator=gen), torch.randn(b, cache, HKV, D, generator=gen),
            torch.randn(b, cache, HKV, D, generator=gen), seqlen)


def _as_decode_step(parents, k, v, seqlen, row, node, cache):
    """The decode step at node ``node``'s position: its path's K/V contiguous after the committed ones."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[row, node])
    path = path[::-1]
    sl = int(seqlen[row])
    k2, v2 = torch.zeros(1, cache, HKV, D), torch.zeros(1, cache, HKV, D)
    k2[0, :sl], v2[0, :sl] = k[row, :sl], v[row, :sl]
    for m, p in enumerate(path):
        k2[0, sl + m], v2[0, sl + m] = k[row, sl + p], v[row, sl + p]
    return k2, v2, torch.tensor([sl + len(path) - 1])


def test_ancestor_slots_list_each_nodes_path_root_first():
    parents = torch.tensor([[-1, 0, 1, 0, 3, 2]])
    slots = ancestor_slots(ancestor_mask(parents))[0]
    assert slots[5, :4].tolist() == [0, 1, 2, 5] and slots[4, :3].tolist() == [0, 3, 4]


@pytest.mark.parametrize("impl,key_split", [("torch", None), ("triton", None), ("triton", 16)])
def test_tree_node_equals_decode_step_at_its_position(impl, key_split, monkeypatch):
    if key_split:  # several slices per row: the merge, and more split programs than one
        monkeypatch.setattr(exact_triton, "KEY_SPLIT", key_split)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents, q, k, v, seqlen = _case(gen)
    anc = ancestor_mask(parents)
    fn = IMPLS[impl]
    out = fn(q, k, v, seqlen, anc)
    assert rel_err(out, tree_attention_ref(q, k, v, seqlen, anc)) < 1e-5
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    b, n = parents.shape
    for row in range(b):
        for node in torch.randperm(n, generator=gen)[:3].tolist():
            for cache in (int(seqlen[row]) + n, 64):
                k2, v2, pos = _as_decode_step(parents, k, v, seqlen, row, node, cache)
                kw = {} if impl == "torch" else {"split_programs": 1 + node % 3}
                got = fn(q[row:row + 1, node:node + 1], k2, v2, pos, one, is_chain=True, **kw)
                assert torch.equal(got[0, 0], out[row, node]), (impl, row, node, cache)


def test_chain_mode_shares_programs_and_changes_no_bit(monkeypatch):
    """Prefill (a chain: several nodes per program) equals the same chain as a tree (a node per program) and each
    position as a decode step."""
    monkeypatch.setattr(exact_triton, "KEY_SPLIT", 16)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    n, sl, cache = 11, 9, 40
    q = torch.randn(1, n, HQ, D, generator=gen)
    k, v = torch.randn(1, cache, HKV, D, generator=gen), torch.randn(1, cache, HKV, D, generator=gen)
    chain = torch.ones(n, n, dtype=torch.bool).tril()[None]
    fn = exact_triton.tree_attention_exact_triton
    as_chain = fn(q, k, v, torch.tensor([sl]), chain, is_chain=True)
    assert torch.equal(as_chain, fn(q, k, v, torch.tensor([sl]), chain))
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    for i in range(0, n, 3):
        assert torch.equal(fn(q[:, i:i + 1], k, v, torch.tensor([sl + i]), one, is_chain=True)[0, 0], as_chain[0, i])
