"""The tree kernels given the pass's tables (conv taps, ancestor mask) equal the same kernels walking ``parents``
and the reference, on every route of ``tree_conv_scan`` (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import KINDS, conv_scan_inputs, padded_batch, rel_err  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels import backend, ops  # noqa: E402
from stree.kernels.tree_conv_scan import tree_conv_scan_ref  # noqa: E402
from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton  # noqa: E402
from stree.kernels.tree_scan_triton import SMALL_MAX_NODES, tree_scan_triton  # noqa: E402
from stree.kernels.tree_tables import ANC_MAX_NODES, TreeTables  # noqa: E402

# (fewest, most) padded nodes of a tree batch on each route: the fused kernel, conv + single-tile scan, conv +
# tiled scan (no mask table there)
ROUTES = {"fused": (1, 16), "two_kernels": (17, 30), "tiled": (65, 68)}


def _random_parents(gen, route):
    """A padded batch of 1-3 random-kind trees whose largest has a size on ``route``."""
    lo, hi = ROUTES[route]
    sizes = [random.randint(lo, hi)] + [random.randint(1, hi) for _ in range(random.randint(0, 2))]
    return padded_batch([(random.choice(KINDS), n) for n in sizes], gen)


def _run(args, tables=None):
    """Kernel outputs (NaN-filled buffers, so unwritten elements show), with the tables of ``tables`` if given."""
    x, (h, p) = args["xBC"], args["ssm_state"].shape[1:3]
    b, n = x.shape[:2]
    nan = float("nan")
    out = (x.new_full((b, n, h, p), nan), torch.full_like(x, nan), x.new_full((b, n, h), nan, dtype=torch.float32))
    kw = {} if tables is None else dict(taps=tables.taps(args["conv_w"].shape[1]), anc=tables.anc)
    return tree_conv_scan_triton(**args, out=out, **kw)


@pytest.mark.parametrize("route", list(ROUTES))
def test_kernels_with_tables_equal_kernels_without_and_the_reference(route):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = _random_parents(gen, route)
    width = random.randint(2, 4) if route == "fused" else random.randint(1, 4)  # width 1 takes the two kernels
    args = conv_scan_inputs(gen, parents, 2, 8, random.randint(1, 2), 8, width, random.random() < 0.5, (0.0, 2.0))
    with count_launches() as c:
        got = _run(args, TreeTables(parents))
    assert c["triton._tree_conv_scan_kernel"] == (route == "fused" and width > 1)
    for g, w, r in zip(got, _run(args), tree_conv_scan_ref(**args)):
        assert torch.equal(g, w)
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("route", ["fused", "two_kernels"])
def test_kernels_read_the_tables_not_parents(route):
    """Given another tree's tables, the kernels compute that tree (both its conv taps and its mask)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lo, hi = ROUTES[route]
    n = random.randint(max(lo, 4), hi)
    chain, bushy = padded_batch([("chain", n)], gen), padded_batch([("bushy", n)], gen)
    args = conv_scan_inputs(gen, chain, 2, 8, 1, 8, 4, True, (0.0, float("inf")))
    for g, r in zip(_run(args, TreeTables(bushy)), tree_conv_scan_ref(**{**args, "parents": bushy})):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("route", ["fused", "two_kernels"])
def test_tables_of_malformed_parents_reproduce_the_kernels_walk(route):
    """Roots anywhere, parents at or after their node, below -1 or past int32: the tables give the kernels'
    own answer."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, n = 2, random.randint(*ROUTES[route])
    parents = torch.randint(-3, n + 2, (b, n), generator=gen)
    parents.view(-1)[random.randrange(b * n)] = random.choice([2**32 + 1, 2**31 - 1, -(2**31)])
    args = conv_scan_inputs(gen, parents, 2, 8, 1, 8, 4, True, (0.0, float("inf")))
    for g, w in zip(_run(args, TreeTables(parents)), _run(args)):
        assert torch.equal(g, w)


def test_single_tile_scan_shares_the_mask_table_between_heads():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("binary", 12), ("deep", 9)], gen)
    a = conv_scan_inputs(gen, parents, 4, 8, 1, 8, 4, False, (0.0, float("inf")))
    x = torch.randn(*parents.shape, 4, 8, generator=gen)
    bc = torch.randn(2, *parents.shape, 1, 8, generator=gen)
    dt = torch.rand(*parents.shape, 4, generator=gen)
    args = (x, dt, a["A"], bc[0], bc[1], a["D"], parents, a["ssm_state"])
    want = tree_scan_triton(*args, heads_per_program=2)
    assert torch.equal(tree_scan_triton(*args, heads_per_program=2, anc=TreeTables(parents).anc), want)


def test_bad_table_shapes_raise_value_error():
    gen = torch.Generator().manual_seed(0)
    parents = padded_batch([("bushy", 6)], gen)
    args = conv_scan_inputs(gen, parents, 2, 8, 1, 8, 4, True, (0.0, float("inf")))
    tables = TreeTables(parents)
    with pytest.raises(ValueError, match="taps"):
        tree_conv_scan_triton(**args, taps=tables.taps(3))
    with pytest.raises(ValueError, match="anc"):
        tree_conv_scan_triton(**args, anc=tables.anc[:, :5])


def test_ops_build_tables_only_for_the_kernel():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("bushy", 7), ("star", 4)], gen)
    args = conv_scan_inputs(gen, parents, 2, 8, 1, 8, 3, True, (0.0, float("inf")))
    assert ANC_MAX_NODES == SMALL_MAX_NODES
    try:
        for which, act in (("torch", "silu"), ("triton", "identity"), ("triton", "silu")):
            backend.use(which)
            tables = TreeTables(parents)
            got = ops.tree_conv_scan(**{**args, "activation": act}, tables=tables)
            built = which == "triton" and act == "silu"  # the reference runs otherwise and reads no table
            assert (3 in tables._taps, tables._anc is not None) == (built, built)
            for g, r in zip(got, tree_conv_scan_ref(**{**args, "activation": act})):
                assert rel_err(g, r) < 1e-5
    finally:
        backend.use(None)
