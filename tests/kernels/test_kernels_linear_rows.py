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
    assert not fits(2, torch.empty(8, MAX_K + 1))
    with pytest.raises(ValueError, match="rows"):
        linear_rows_triton(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="rows"):
        linear_rows_triton(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="bias"):
        linear_rows_triton(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))
