"""The tree pass's kernel tables (conv taps, ancestor mask) against plain Python walks of the kernels' own rules,
on random trees, padded batches and malformed parents."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_trees import KINDS, padded_batch
from stree.kernels.tree_conv import tree_conv_taps
from stree.kernels.tree_tables import ANC_MAX_NODES, TreeTables, conv_taps, kernel_ancestor_mask
from stree.protocols.token_tree import ancestor_mask
from tree_strategies import parent_lists


def _int32(v: int) -> int:
    """``v`` as the kernels read it (an int32 load of the parents)."""
    return (v + 2**31) % 2**32 - 2**31


def walk_taps(par: list[int], width: int) -> list[list[int]]:
    """``tree_conv_tile``'s walk, step by step: node, then up (clamped) while on a node, else one column back."""
    out = []
    for node in range(len(par)):
        cur, row = node, []
        for _ in range(width):
            row.append(cur)
            cur = min(max(_int32(par[cur]), -1), cur - 1) if cur > 0 else cur - 1
        out.append(row)
    return out


def walk_anc(par: list[int]) -> list[list[bool]]:
    """``small_tree_mask``'s rule: j is i or reached from i by parent edges that each point to an earlier node."""
    n = len(par)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        cur = i
        while cur >= 0:
            mask[i][cur] = True
            up = _int32(par[cur])
            cur = up if 0 <= up < cur else -1
    return mask


def _check(parents: torch.Tensor, width: int) -> None:
    tables = TreeTables(parents)
    taps, anc = tables.taps(width), tables.anc
    assert taps.dtype == torch.int32 and taps.shape == (*parents.shape, width)
    assert anc.dtype == torch.bool and anc.shape == (*parents.shape, parents.shape[1])
    for row, par in enumerate(parents.tolist()):
        assert taps[row].tolist() == walk_taps(par, width)
        assert anc[row].tolist() == walk_anc(par)


@given(par=parent_lists(max_nodes=20), width=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_tables_of_well_formed_trees(par, width):
    parents = torch.tensor([par])
    _check(parents, width)
    # on well-formed trees the kernels' mask is the attention mask and the taps the reference's conv rows
    assert torch.equal(kernel_ancestor_mask(parents), ancestor_mask(parents))
    assert torch.equal(conv_taps(parents, width).long(), tree_conv_taps(parents, width) - (width - 1))


@given(data=st.data(), n=st.integers(1, 12), width=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_tables_of_malformed_parents_follow_the_kernels_sanitising(data, n, width):
    """Roots anywhere, parents at or after their node, below -1, or past int32 (read wrapped, as the kernels do)."""
    par = data.draw(st.lists(st.integers(-3, n + 2) | st.sampled_from([2**32 + 1, -(2**33) + 2, 2**31 - 1, -(2**31)]),
                             min_size=n, max_size=n))
    _check(torch.tensor([par]), width)


def test_tables_of_padded_batches_and_chains():
    gen = torch.Generator().manual_seed(0)
    parents = padded_batch([(kind, 3 + 2 * i) for i, kind in enumerate(KINDS)], gen)
    for width in (1, 2, 3, 4):
        _check(parents, width)
    chain = torch.arange(-1, 9)[None]
    assert torch.equal(conv_taps(chain, 4)[0], torch.arange(10)[:, None] - torch.arange(4)[None, :])


def test_tables_are_built_once_and_the_mask_only_for_small_trees():
    parents = padded_batch([("bushy", 9)], torch.Generator().manual_seed(1))
    tables = TreeTables(parents)
    assert tables.taps(4) is tables.taps(4) and tables.anc is tables.anc
    assert tables.taps(2).shape[-1] == 2  # one table per conv width
    big = torch.arange(-1, ANC_MAX_NODES)[None]
    assert TreeTables(big).anc is None and TreeTables(big[:, :ANC_MAX_NODES]).anc is not None
