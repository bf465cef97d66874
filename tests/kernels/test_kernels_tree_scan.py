"""Tree-scan Triton kernel vs ``tree_scan_ref`` under the Triton CPU interpreter (fp32, tiny shapes)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import KINDS, padded_batch, rel_err  # noqa: E402
from stree.kernels.tree_scan import tree_scan_ref  # noqa: E402
from stree.kernels.tree_scan_triton import MAX_NODES, tree_scan_triton  # noqa: E402


def _inputs(parents, heads, headdim, d_state, groups, gen, dtype=torch.float32):
    b, n = parents.shape
    return dict(
        x=torch.randn(b, n, heads, headdim, generator=gen).to(dtype),
        dt=torch.nn.functional.softplus(torch.randn(b, n, heads, generator=gen) - 1.0),
        A=-torch.rand(heads, generator=gen) * 2 - 0.1,
        Bm=torch.randn(b, n, groups, d_state, generator=gen).to(dtype),
        Cm=torch.randn(b, n, groups, d_state, generator=gen).to(dtype),
        D=torch.randn(heads, generator=gen),
        parents=parents,
        ssm_state=torch.randn(b, heads, headdim, d_state, generator=gen),
    )


def _check(inp, tol=1e-5, **kw):
    ref = tree_scan_ref(**inp)
    out = torch.full_like(inp["x"], float("nan"))
    tree_scan_triton(**inp, out=out, **kw)
    assert torch.isfinite(out).all(), "some outputs were never written"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_single_tree_kinds(kind):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 21, (1,), generator=gen))
    parents = padded_batch([(kind, n)], gen)
    _check(_inputs(parents, 2, 8, 8, 1, gen))


def test_padded_batch_of_different_trees_and_groups():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("bushy", 17), ("chain", 5), ("star", 1)], gen)
    _check(_inputs(parents, 4, 16, 16, 2, gen))


def test_tiled_kernel_matches_for_multi_block_trees():
    # block_m=16 with 24 nodes: two row blocks and column blocks, the path larger trees take
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("deep", 24), ("bushy", 20)], gen)
    _check(_inputs(parents, 2, 8, 16, 1, gen), block_m=16)


def test_heads_per_program_and_headdim_blocks():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("binary", 12)], gen)
    _check(_inputs(parents, 4, 32, 8, 1, gen), heads_per_program=2, block_p=16)


def test_chain_mode_ignores_parents():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    inp = _inputs(padded_batch([("chain", 19)], gen), 2, 8, 8, 1, gen)
    ref = tree_scan_ref(**inp)
    inp["parents"] = torch.zeros_like(inp["parents"])  # not read in chain mode
    for block_m in (None, 16):
        out = tree_scan_triton(**inp, is_chain=True, block_m=block_m)
        assert rel_err(out, ref) < 1e-5


def test_fp16_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    _check(_inputs(padded_batch([("bushy", 14)], gen), 2, 16, 16, 1, gen, torch.float16), tol=1e-2)


def test_bad_shapes_raise_value_error():
    gen = torch.Generator().manual_seed(0)
    inp = _inputs(padded_batch([("chain", 4)], gen), 2, 8, 8, 1, gen)
    with pytest.raises(ValueError, match="parents"):
        tree_scan_triton(**{**inp, "parents": inp["parents"][:, :3]})
    big = torch.zeros(1, MAX_NODES + 1, 1, 1)
    with pytest.raises(ValueError, match="limit"):
        tree_scan_triton(big, big[..., 0], torch.zeros(1), torch.zeros(1, MAX_NODES + 1, 1, 1),
                         torch.zeros(1, MAX_NODES + 1, 1, 1), torch.zeros(1),
                         torch.zeros(1, MAX_NODES + 1, dtype=torch.long), torch.zeros(1, 1, 1, 1))
