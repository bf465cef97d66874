"""Fused tree conv + dt + tree scan Triton kernel vs ``tree_conv_scan_ref`` (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import padded_batch, rel_err  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels import backend, ops  # noqa: E402
from stree.kernels.tree_conv_scan import tree_conv_scan_ref  # noqa: E402
from stree.kernels.tree_conv_scan_triton import FUSED_LIMIT, FUSED_MAX_NODES, tree_conv_scan_triton  # noqa: E402


def _inputs(gen, parents, heads, headdim, groups, d_state, width, bias, dt_limit):
    """Random layer inputs; xBC and dt_raw are column slices of one wider tensor, as in_proj gives them."""
    b, n = parents.shape
    c = heads * headdim + 2 * groups * d_state
    zxbcdt = torch.randn(b, n, 3 + c + heads, generator=gen)
    return dict(
        xBC=zxbcdt[..., 3:3 + c], conv_state=torch.randn(b, c, width - 1, generator=gen),
        conv_w=torch.randn(c, width, generator=gen) * 0.6,
        conv_b=torch.randn(c, generator=gen) if bias else None, parents=parents,
        dt_raw=zxbcdt[..., 3 + c:] * 2, dt_bias=torch.randn(heads, generator=gen), dt_limit=dt_limit,
        activation="silu", A=-torch.rand(heads, generator=gen) * 2 - 0.1, D=torch.randn(heads, generator=gen),
        ngroups=groups, headdim=headdim, ssm_state=torch.randn(b, heads, headdim, d_state, generator=gen),
    )


def _check(args, **kw):
    states = (args["conv_state"].clone(), args["ssm_state"].clone())
    ref = tree_conv_scan_ref(**args)
    out = tuple(torch.full_like(r, float("nan")) for r in ref)
    got = tree_conv_scan_triton(**args, out=out, **kw)
    assert all(g is o for g, o in zip(got, out))
    for name, o, r in zip(("y", "xbc", "dt"), out, ref):
        assert torch.isfinite(o).all(), f"some of {name} was never written"
        assert o.dtype == r.dtype and rel_err(o, r) < 1e-5, f"{name}: relative error {rel_err(o, r):.2e}"
    assert torch.equal(args["conv_state"], states[0]) and torch.equal(args["ssm_state"], states[1])


@pytest.mark.parametrize("specs,heads,headdim,groups,d_state,width,bias,dt_limit", [
    # padded batch of a chain, a star and a deep tree; one group, d_state 12
    ([("chain", 9), ("star", 7), ("deep", 13)], 2, 8, 1, 12, 4, True, (0.0, float("inf"))),
    # two groups of two heads, two headdim blocks (40 = 32 + 8), width 2, no bias, dt clamped both ways
    ([("bushy", 17), ("binary", 11)], 4, 40, 2, 10, 2, False, (0.05, 1.5)),
    # one tree of 32 nodes (the largest fused tile, FUSED_LIMIT), clamped from above only
    ([("deep", 32)], 2, 8, 2, 20, 4, True, (0.0, 0.8)),
])
def test_fused_tree_conv_scan_matches_reference(specs, heads, headdim, groups, d_state, width, bias, dt_limit):
    """The fused kernel at every tile size it takes (routing by default stops at FUSED_MAX_NODES)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch(specs, gen), heads, headdim, groups, d_state, width, bias, dt_limit)
    with count_launches() as c:
        _check(args, max_fused_nodes=64)
    assert c["triton._tree_conv_scan_kernel"] == 1


def test_trees_over_the_fused_limit_take_the_two_kernels_even_when_asked():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch([("bushy", FUSED_LIMIT + 1)], gen), 2, 8, 1, 8, 4, True, (0.0, 1.0))
    with count_launches() as c:
        _check(args, max_fused_nodes=64)
    assert c["triton._tree_conv_kernel"] == 1 and c["triton._tree_conv_scan_kernel"] == 0


def test_trees_over_the_fused_size_take_the_two_kernels_by_default():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch([("bushy", FUSED_MAX_NODES + 1)], gen), 2, 8, 1, 8, 4, True, (0.0, 1.0))
    with count_launches() as c:
        _check(args)
    assert c["triton._tree_conv_kernel"] == 1 and c["triton._tree_conv_scan_kernel"] == 0


@pytest.mark.parametrize("specs,width", [([("bushy", 70)], 4), ([("deep", 12), ("star", 5)], 1)])
def test_large_trees_and_width_one_take_the_two_unfused_kernels(specs, width):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch(specs, gen), 2, 8, 1, 8, width, True, (0.0, float("inf")))
    with count_launches() as c:
        _check(args)
    assert c["triton._tree_conv_kernel"] == 1 and c["triton._tree_conv_scan_kernel"] == 0


def test_ops_routing_and_unfused_activation():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch([("bushy", 6)], gen), 2, 8, 1, 8, 3, True, (0.0, float("inf")))
    with pytest.raises(ValueError, match="activation"):
        tree_conv_scan_triton(**{**args, "activation": "identity"})
    backend.use("triton")
    try:
        for act in ("silu", "identity"):  # identity is not fused: the reference runs
            with count_launches() as c:
                got = ops.tree_conv_scan(**{**args, "activation": act})
            assert c["triton._tree_conv_scan_kernel"] == (act == "silu")
            for o, r in zip(got, tree_conv_scan_ref(**{**args, "activation": act})):
                assert rel_err(o, r) < 1e-5
    finally:
        backend.use(None)


@pytest.mark.parametrize("n,block_p", [(5, None), (16, 16)])
def test_chain_mode_matches_the_reference_on_chains(n, block_p):
    """``is_chain=True`` (no parent loads, no mask closure) equals the reference on real chains, in the whole-tree
    kernel (``chain_max_nodes=0``: short chains would otherwise run the sequential chain kernel)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = (torch.arange(n) - 1).expand(2, n).contiguous()
    args = _inputs(gen, parents, 2, 40, 1, 12, 4, True, (0.0, float("inf")))
    with count_launches() as c:
        _check(args, is_chain=True, block_p=block_p, num_warps=2, chain_max_nodes=0)
    assert c["triton._tree_conv_scan_kernel"] == 1


@pytest.mark.parametrize("specs,width,backend_name", [
    ([("bushy", 7), ("chain", 5)], 4, "triton"),  # the fused kernel writes the copy itself
    ([("deep", FUSED_MAX_NODES + 3)], 4, "triton"),  # the two unfused kernels, then a copy
    ([("star", 6)], 3, "torch"),  # the reference, then copies
])
def test_acts_out_receives_the_activations_and_a_copy_of_xbc(specs, width, backend_name):
    """``acts_out`` (slices of a model-wide stack, for the one-launch commit) get xbc, dt and the pre-conv xBC."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    args = _inputs(gen, padded_batch(specs, gen), 4, 8, 2, 8, width, True, (0.0, float("inf")))
    b, n, c = args["xBC"].shape
    stack_xbc = torch.full((3, b, n, c), float("nan"))
    stack_dt = torch.full((3, b, n, 4), float("nan"))
    stack_pre = torch.full((3, b, n, c), float("nan"))
    backend.use(backend_name)
    try:
        y, xbc, dt = ops.tree_conv_scan(**args, acts_out=(stack_xbc[1], stack_dt[1], stack_pre[1]))
    finally:
        backend.use(None)
    ref = tree_conv_scan_ref(**args)
    assert xbc.data_ptr() == stack_xbc[1].data_ptr() and dt.data_ptr() == stack_dt[1].data_ptr()
    for got, want in zip((y, xbc, dt), ref):
        assert rel_err(got, want) < 1e-5
    assert torch.equal(stack_pre[1], args["xBC"])
    for stack in (stack_xbc, stack_dt, stack_pre):  # nothing written outside the layer's slice
        assert torch.isnan(stack[0]).all() and torch.isnan(stack[2]).all()
