"""The one-launch greedy verification kernel equals its reference on random padded tree batches."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import KINDS, padded_batch  # noqa: E402
from stree.kernels.greedy_verify import greedy_verify_ref  # noqa: E402
from stree.kernels.greedy_verify_triton import MAX_NODES, greedy_verify_triton  # noqa: E402


def _batch(gen, sizes, vocab=3):
    """Random trees whose tokens often follow the argmax (so paths are long), with padding rows."""
    specs = [(KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))], n) for n in sizes]
    parents = padded_batch(specs, gen)
    b, n = parents.shape
    valid = torch.arange(n)[None, :] < torch.tensor(sizes)[:, None]
    best = torch.randint(0, vocab, (b, n), generator=gen)
    follow = torch.rand(b, n, generator=gen) < 0.7
    tokens = torch.where(follow, best.gather(1, parents.clamp_min(0)), torch.randint(0, vocab, (b, n), generator=gen))
    return tokens, parents, valid, best


@pytest.mark.parametrize("seed", range(6))
def test_greedy_kernel_matches_reference_on_random_trees(seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(4)]
    tokens, parents, valid, best = _batch(gen, sizes)
    for max_depth, max_width in ((64, 64), (3, 2), (0, 1), (5, 1)):
        got = greedy_verify_triton(tokens, parents, valid, best, max_depth, max_width)
        want = greedy_verify_ref(tokens, parents, valid, best, max_depth, max_width)
        for g, w, name in zip(got, want, ("path", "path_len", "bonus", "out_tokens")):
            assert torch.equal(g, w), (name, max_depth, max_width, g, w)


def test_greedy_kernel_takes_the_lowest_index_among_equal_siblings():
    # root 0 has two children with the argmax token: node 1 (a leaf) and node 2 (with an accepted child 3)
    tokens = torch.tensor([[5, 7, 7, 9]])
    parents = torch.tensor([[-1, 0, 0, 2]])
    best = torch.tensor([[7, 1, 9, 4]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    path, plen, bonus, out = greedy_verify_triton(tokens, parents, valid, best, 3, 4)
    assert path.tolist() == [[0, 2, 3, 0]] and plen.tolist() == [3] and bonus.tolist() == [4]
    assert out.tolist() == [[7, 9, 4, 0]]
    path, plen, bonus, out = greedy_verify_triton(tokens, parents, valid, best, 3, 1)  # node 2 is past the width
    assert path.tolist() == [[0, 1, 0, 0]] and out.tolist() == [[7, 1, 0, 0]]


def test_greedy_kernel_refuses_big_trees():
    n = MAX_NODES + 1
    z = torch.zeros(1, n, dtype=torch.long)
    with pytest.raises(ValueError, match="one-program limit"):
        greedy_verify_triton(z, z, z.bool(), z, 3, 3)
