"""Few-row Triton linear vs ``F.linear`` (CPU interpreter, fp32), on random shapes, strides and row counts."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

from stree.kernels.linear_rows_triton import MAX_K, MAX_ROWS, fits, linear_rows_triton  # noqa: E402


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 70), bias=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_linear_rows_matches_f_linear(m, k, n, bias, strided, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    # strided rows and columns, as the split views of a wider projection are
    x = torch.randn(m, 2 * k + 3, generator=g)[:, 3::2] if strided else torch.randn(m, k, generator=g)
    got = linear_rows_triton(x, w, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_linear_rows_keeps_leading_dims():
    x, w = torch.randn(2, 3, 40), torch.randn(24, 40)
    torch.testing.assert_close(linear_rows_triton(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_linear_rows_refuses_what_it_cannot_take():
    assert fits(MAX_ROWS, torch.empty(8, MAX_K)) and not fits(MAX_ROWS + 1, torch.empty(8, 8))
    assert not fits(2, torch.empty(8, MAX_K + 1)) and fits(1, torch.empty(8, 2560))
    with pytest.raises(ValueError, match="rows"):
        linear_rows_triton(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="rows"):
        linear_rows_triton(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="bias"):
        linear_rows_triton(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 9), k=st.integers(2100, 2600), n=st.integers(1, 20), bias=st.booleans(),
       stages=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_long_k_loop_matches_f_linear(m, k, n, bias, stages, seed):
    """Past ``UNROLL_K`` the kernel loops over K chunks (pipelined on the GPU); a ragged last chunk included."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = linear_rows_triton(x, w, b, num_stages=stages)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=2e-4, rtol=2e-4)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 200), n=st.integers(1, 40), residual=st.booleans(),
       residual_in_fp32=st.booleans(), bias=st.booleans(), unroll=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_add_rmsnorm_prologue_matches_reference(m, k, n, residual, residual_in_fp32, bias, unroll, seed):
    """Residual add + RMSNorm fused before the projection: same output and the same new residual."""
    from stree.kernels.linear_rows_triton import add_rmsnorm_linear_rows_triton
    from stree.kernels.norm_linear import add_rmsnorm_linear_ref

    g = torch.Generator().manual_seed(seed)
    x, nw, w = torch.randn(2, m, k, generator=g), torch.rand(k, generator=g) + 0.5, torch.randn(n, k, generator=g)
    r = torch.randn(2, m, k, generator=g) if residual else None
    b = torch.randn(n, generator=g) if bias else None
    y, r_out = add_rmsnorm_linear_rows_triton(x[:, : max(1, m // 2)], None if r is None else r[:, : max(1, m // 2)],
                                              nw, 1e-5, residual_in_fp32, w, b, unroll=unroll, block_k=32)
    y0, r0 = add_rmsnorm_linear_ref(x[:, : max(1, m // 2)], None if r is None else r[:, : max(1, m // 2)], nw,
                                    1e-5, residual_in_fp32, w, b)
    torch.testing.assert_close(y, y0, atol=1e-4, rtol=1e-4)
    assert r_out.dtype == r0.dtype and torch.equal(r_out, r0)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 12), groups=st.integers(1, 4), group_size=st.integers(1, 70), n=st.integers(1, 30),
       norm_before_gate=st.booleans(), bias=st.booleans(), block_k=st.sampled_from([16, 64]),
       seed=st.integers(0, 2**31 - 1))
def test_gated_rmsnorm_prologue_matches_reference(m, groups, group_size, n, norm_before_gate, bias, block_k, seed):
    """Mamba2's gated grouped RMSNorm fused before the projection (groups that split or straddle K chunks)."""
    from stree.kernels.linear_rows_triton import gated_rmsnorm_linear_rows_triton
    from stree.kernels.norm_linear import gated_rmsnorm_linear_ref

    g = torch.Generator().manual_seed(seed)
    k = groups * group_size
    y, z = torch.randn(m, k, generator=g), torch.randn(m, k, generator=g)
    nw, w = torch.rand(k, generator=g) + 0.5, torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = gated_rmsnorm_linear_rows_triton(y, z, nw, group_size, 1e-5, norm_before_gate, w, b, block_k=block_k)
    want = gated_rmsnorm_linear_ref(y, z, nw, group_size, 1e-5, norm_before_gate, w, b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gated_prologue_refuses_a_ragged_group():
    from stree.kernels.linear_rows_triton import gated_rmsnorm_linear_rows_triton

    with pytest.raises(ValueError, match="groups of 7"):
        gated_rmsnorm_linear_rows_triton(torch.randn(2, 20), torch.randn(2, 20), torch.ones(20), 7, 1e-5, False,
                                         torch.randn(3, 20))


@pytest.mark.parametrize("m", [1, 5, 8])
def test_prologues_whose_group_fits_one_chunk_match_reference(m):
    """A norm group inside one K chunk loads its rows once for the norm and the product (the demo pair's
    5-row tree pass): both prologues, several groups, against the references."""
    from stree.kernels.linear_rows_triton import add_rmsnorm_linear_rows_triton, gated_rmsnorm_linear_rows_triton
    from stree.kernels.norm_linear import add_rmsnorm_linear_ref, gated_rmsnorm_linear_ref

    x, r, z = torch.randn(m, 48), torch.randn(m, 48), torch.randn(m, 48)
    nw, w, b = torch.rand(48) + 0.5, torch.randn(20, 48), torch.randn(20)
    y, r_out = add_rmsnorm_linear_rows_triton(x, r, nw, 1e-5, True, w, b, block_k=64, unroll=True)
    y0, r0 = add_rmsnorm_linear_ref(x, r, nw, 1e-5, True, w, b)
    torch.testing.assert_close(y, y0, atol=1e-4, rtol=1e-4)
    assert torch.equal(r_out, r0)
    for before in (False, True):
        got = gated_rmsnorm_linear_rows_triton(x, z, nw, 16, 1e-5, before, w, b, block_k=16)
        torch.testing.assert_close(got, gated_rmsnorm_linear_ref(x, z, nw, 16, 1e-5, before, w, b), atol=1e-4,
                                   rtol=1e-4)
