"""Row-padded linear: padding the input never changes the rows that come back, and ``ops.linear`` keeps
CPU, single-row and training calls on plain ``F.linear``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from stree.kernels import ops  # noqa: E402
from stree.kernels.linear import padded_linear  # noqa: E402


@pytest.mark.parametrize("rows, padded", [(1, 1), (2, 8), (5, 8), (5, 16), (13, 16), (21, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_padding_keeps_every_row(rows, padded, bias):
    seed = rows * 100 + padded * 2 + bias
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 72, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(rows, 144, generator=g)[:, ::2]  # strided rows, as split views are
    got = padded_linear(x, w, b, padded)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5, msg=f"seed {seed}")


def test_padding_keeps_leading_dims_and_refuses_to_shrink():
    x, w = torch.randn(2, 3, 16), torch.randn(24, 16)
    torch.testing.assert_close(padded_linear(x, w, None, 16), x @ w.t(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot pad 6 rows down to 4"):
        padded_linear(x, w, None, 4)


def test_ops_linear_on_cpu_is_f_linear_and_trains():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    y = ops.linear(x, lin.weight, lin.bias)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    y.sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_triton_kernel_equals_f_linear(rows, bias):
    """The few-row Triton linear (fp32, interpreter) equals F.linear on strided inputs with leading dims."""
    pytest.importorskip("triton")
    from stree.kernels.linear_triton import few_row_linear_triton

    g = torch.Generator().manual_seed(rows * 10 + bias)
    w = torch.randn(37, 150, generator=g)  # columns and K not multiples of the blocks
    b = torch.randn(37, generator=g) if bias else None
    x = torch.randn(1, rows, 300, generator=g)[..., ::2]
    got = few_row_linear_triton(x, w, b)
    assert got.shape == (1, rows, 37)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_few_row_triton_kernel_refuses_bad_shapes():
    pytest.importorskip("triton")
    from stree.kernels.linear_triton import few_row_linear_triton

    with pytest.raises(ValueError, match="at most 32 rows"):
        few_row_linear_triton(torch.randn(33, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="bias"):
        few_row_linear_triton(torch.randn(3, 8), torch.randn(4, 8), torch.randn(5))
