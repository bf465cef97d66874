"""The row-invariant PyTorch pieces (``rowwise``) and the references built on them: a row's (or an element's) result
never depends on the tensor around it, which PyTorch's own CPU reductions and SIMD transcendental functions do not
promise."""

import random

import pytest
import torch
from hypothesis import given, strategies as st

from invariance_helpers import row_failures
from stree.kernels import numerics, rowwise
from stree.kernels.norms import add_rmsnorm_ref, gated_rmsnorm_ref
from stree.kernels.rotary import rotary_inv_freq, rotary_ref


@given(st.integers(1, 300), st.integers(0, 5), st.integers(0, 2**31 - 1))
def test_fixed_sum_is_blind_to_zero_padding_and_close_to_sum(n, extra_pow, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(3, n, generator=gen)
    padded = torch.cat([t, torch.zeros(3, (1 << extra_pow) * n)], 1)
    assert torch.equal(rowwise.fixed_sum(padded), rowwise.fixed_sum(t))
    torch.testing.assert_close(rowwise.fixed_sum(t), t.sum(-1), atol=1e-4, rtol=1e-5)
    assert torch.equal(rowwise.fixed_sum(t.t(), 0), rowwise.fixed_sum(t))


@pytest.mark.parametrize("fn", [rowwise.silu, rowwise.softplus, rowwise.sigmoid, rowwise.gelu, rowwise.exp])
def test_pointwise_functions_give_every_element_the_same_bits_anywhere(fn):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(1001, generator=gen) * 6
    full = fn(x)
    for i in torch.randint(0, 1001, (40,), generator=gen).tolist():
        assert torch.equal(fn(x[i:i + 1]), full[i:i + 1])
    assert torch.equal(fn(x[1:].reshape(-1, 8)).reshape(-1), full[1:])


def test_norm_and_rotary_references_are_row_invariant():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    d = 96
    w = torch.rand(d, generator=gen) + 0.5
    rows = torch.randn(20, 2, d, generator=gen)  # (x, residual) per row
    with torch.no_grad():
        assert numerics.exact()
        assert row_failures(lambda t: add_rmsnorm_ref(t[:, 0], t[:, 1], w, 1e-5)[0], rows, gen=gen) == 0
        assert row_failures(lambda t: gated_rmsnorm_ref(t[:, 0], t[:, 1], w, 32, 1e-5), rows, gen=gen) == 0
        inv = rotary_inv_freq(16, 10000.0, "cpu")
        pos_rows = torch.randn(20, 1, 3, 24, generator=gen)  # a row: one token, 3 heads

        def rot(t):
            return rotary_ref(t.transpose(0, 1), torch.arange(t.shape[0])[None] * 0 + 77, inv, False)[0]

        assert row_failures(rot, pos_rows, gen=gen) == 0
