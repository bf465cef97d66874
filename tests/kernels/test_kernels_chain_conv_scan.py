"""The sequential chain conv + dt + scan kernel vs ``tree_conv_scan_ref`` on chains (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import rel_err  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels.chain_conv_scan_triton import CHAIN_MAX_NODES  # noqa: E402
from stree.kernels.tree_conv_scan import tree_conv_scan_ref  # noqa: E402
from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton  # noqa: E402


def _chain_inputs(gen, b, n, heads, headdim, groups, d_state, width, bias, dt_limit):
    """Random layer inputs over ``b`` chains of ``n`` nodes; xBC and dt_raw are column slices of one wider tensor."""
    c = heads * headdim + 2 * groups * d_state
    zxbcdt = torch.randn(b, n, 3 + c + heads, generator=gen)
    return dict(
        xBC=zxbcdt[..., 3:3 + c], conv_state=torch.randn(b, c, width - 1, generator=gen),
        conv_w=torch.randn(c, width, generator=gen) * 0.6,
        conv_b=torch.randn(c, generator=gen) if bias else None, parents=(torch.arange(n) - 1).expand(b, n).contiguous(),
        dt_raw=zxbcdt[..., 3 + c:] * 2, dt_bias=torch.randn(heads, generator=gen), dt_limit=dt_limit,
        activation="silu", A=-torch.rand(heads, generator=gen) * 2 - 0.1, D=torch.randn(heads, generator=gen),
        ngroups=groups, headdim=headdim, ssm_state=torch.randn(b, heads, headdim, d_state, generator=gen),
    )


def _run(args, pre=False, **kw):
    """The kernel's outputs (NaN-poisoned first) beside the reference's; both states must stay untouched."""
    states = (args["conv_state"].clone(), args["ssm_state"].clone())
    ref = tree_conv_scan_ref(**args)
    out = tuple(torch.full_like(r, float("nan")) for r in ref)
    copy = torch.full_like(args["xBC"], float("nan")) if pre else None
    got = tree_conv_scan_triton(**args, out=out, pre=copy, is_chain=True, **kw)
    assert all(g is o for g, o in zip(got, out))
    for name, o, r in zip(("y", "xbc", "dt"), out, ref):
        assert torch.isfinite(o).all(), f"some of {name} was never written"
        assert o.dtype == r.dtype and rel_err(o, r) < 1e-5, f"{name}: relative error {rel_err(o, r):.2e}"
    if pre:
        assert torch.equal(copy, args["xBC"])
    assert torch.equal(args["conv_state"], states[0]) and torch.equal(args["ssm_state"], states[1])


def test_random_chains_match_the_reference():
    """Fresh random shapes: chain length 1..CHAIN_MAX_NODES, batch, heads per group, headdim blocks, d_state,
    conv width, bias, dt clamp, with and without the pre-conv copy. One launch of the chain kernel each."""
    rng = random.Random(random.randrange(2**31))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for _ in range(4):
        groups = rng.choice([1, 2])
        heads = groups * rng.choice([1, 2])
        args = _chain_inputs(gen, rng.randint(1, 3), rng.randint(1, CHAIN_MAX_NODES), heads, rng.choice([8, 24]),
                             groups, rng.choice([8, 12, 20]), rng.choice([2, 3, 4]), rng.random() < 0.5,
                             rng.choice([(0.0, float("inf")), (0.05, 1.5), (0.0, 0.8)]))
        with count_launches() as c:
            _run(args, pre=rng.random() < 0.5, block_p=rng.choice([None, 8, 16]), num_warps=2)
        assert c["triton._chain_conv_scan_kernel"] == 1 and c["triton._tree_conv_scan_kernel"] == 0


def test_longer_chains_and_trees_take_the_tile_kernel():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _chain_inputs(gen, 2, CHAIN_MAX_NODES + 1, 2, 8, 1, 8, 4, True, (0.0, float("inf")))
    with count_launches() as c:
        _run(args)
    assert c["triton._chain_conv_scan_kernel"] == 0 and c["triton._tree_conv_scan_kernel"] == 1
    with count_launches() as c:  # not marked as a chain: the whole-tree kernel reads the parents
        tree_conv_scan_triton(**_chain_inputs(gen, 1, 4, 2, 8, 1, 8, 4, True, (0.0, float("inf"))))
    assert c["triton._chain_conv_scan_kernel"] == 0 and c["triton._tree_conv_scan_kernel"] == 1
