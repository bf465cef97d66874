"""Chain recurrence kernel (conv + dt + scan over a chain) vs ``tree_conv_scan_ref`` (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kernel_trees import rel_err  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels import backend, ops  # noqa: E402
from stree.kernels.chain_conv_scan_triton import CHAIN_MAX_NODES  # noqa: E402
from stree.kernels.tree_conv_scan import tree_conv_scan_ref  # noqa: E402
from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton  # noqa: E402


def _chain_inputs(gen, b, n, heads, headdim, groups, d_state, width, bias, dt_limit):
    """Random layer inputs over ``b`` chains of ``n`` nodes; xBC and dt_raw are slices of one in_proj output."""
    c = heads * headdim + 2 * groups * d_state
    zxbcdt = torch.randn(b, n, 5 + c + heads, generator=gen)
    return dict(
        xBC=zxbcdt[..., 5:5 + c], conv_state=torch.randn(b, c, width - 1, generator=gen),
        conv_w=torch.randn(c, width, generator=gen) * 0.6, conv_b=torch.randn(c, generator=gen) if bias else None,
        parents=(torch.arange(n) - 1).expand(b, n).contiguous(), dt_raw=zxbcdt[..., 5 + c:] * 2,
        dt_bias=torch.randn(heads, generator=gen), dt_limit=dt_limit, activation="silu",
        A=-torch.rand(heads, generator=gen) * 2 - 0.1, D=torch.randn(heads, generator=gen), ngroups=groups,
        headdim=headdim, ssm_state=torch.randn(b, heads, headdim, d_state, generator=gen),
    )


def _check_chain(args, **kw):
    """NaN-poisoned outputs, states untouched, every output close to the reference; returns the launch counts."""
    states = (args["conv_state"].clone(), args["ssm_state"].clone())
    ref = tree_conv_scan_ref(**args)
    out = tuple(torch.full_like(r, float("nan")) for r in ref)
    with count_launches() as c:
        got = tree_conv_scan_triton(**args, out=out, is_chain=True, **kw)
    assert all(g is o for g, o in zip(got, out))
    for name, o, r in zip(("y", "xbc", "dt"), out, ref):
        assert torch.isfinite(o).all(), f"some of {name} was never written"
        assert rel_err(o, r) < 1e-5, f"{name}: relative error {rel_err(o, r):.2e}"
    assert torch.equal(args["conv_state"], states[0]) and torch.equal(args["ssm_state"], states[1])
    return c


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, CHAIN_MAX_NODES), heads_per_group=st.integers(1, 3),
       groups=st.integers(1, 2), headdim=st.integers(1, 40), d_state=st.integers(1, 40), width=st.integers(2, 4),
       bias=st.booleans(), clamp=st.booleans(), block_p=st.sampled_from([None, 8, 16]), seed=st.integers(0, 2**31))
def test_chain_kernel_matches_reference(b, n, heads_per_group, groups, headdim, d_state, width, bias, clamp, block_p,
                                        seed):
    """Every chain length it takes, headdim split over blocks or not, shared or per-head B/C groups, every conv
    width, with and without bias and dt clamp: one launch of the recurrence kernel, equal to the reference."""
    gen = torch.Generator().manual_seed(seed)
    args = _chain_inputs(gen, b, n, heads_per_group * groups, headdim, groups, d_state, width, bias,
                         (0.05, 1.5) if clamp else (0.0, float("inf")))
    c = _check_chain(args, block_p=block_p)
    assert c["triton._chain_conv_scan_kernel"] == 1 and c["triton._tree_conv_scan_kernel"] == 0


def test_chain_kernel_takes_the_largest_state():
    gen = torch.Generator().manual_seed(7)
    args = _chain_inputs(gen, 1, 5, 2, 16, 1, 256, 4, True, (0.0, float("inf")))
    assert _check_chain(args)["triton._chain_conv_scan_kernel"] == 1


@pytest.mark.parametrize("n,d_state,chain", [(CHAIN_MAX_NODES + 1, 8, None), (5, 300, None), (5, 8, False)])
def test_chains_it_does_not_take_go_to_the_tree_kernels(n, d_state, chain):
    """Longer chains, larger states, or ``chain=False`` run the tree kernels (still equal to the reference)."""
    gen = torch.Generator().manual_seed(11)
    args = _chain_inputs(gen, 2, n, 2, 8, 1, d_state, 4, True, (0.0, float("inf")))
    c = _check_chain(args, chain=chain)
    assert c["triton._chain_conv_scan_kernel"] == 0


def test_ops_route_chains_to_the_recurrence_and_trees_to_the_tree_kernel():
    gen = torch.Generator().manual_seed(3)
    args = _chain_inputs(gen, 2, 6, 2, 8, 1, 8, 4, True, (0.0, float("inf")))
    backend.use("triton")
    try:
        for is_chain in (True, False):  # the same chain, with and without the hint
            with count_launches() as c:
                got = ops.tree_conv_scan(**args, is_chain=is_chain)
            assert c["triton._chain_conv_scan_kernel"] == int(is_chain)
            assert c["triton._tree_conv_scan_kernel"] == int(not is_chain)
            for o, r in zip(got, tree_conv_scan_ref(**args)):
                assert rel_err(o, r) < 1e-5
    finally:
        backend.use(None)
