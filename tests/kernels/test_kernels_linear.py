"""Row-padded linear: padding the input never changes the rows that come back, and ``ops.linear`` keeps
CPU, single-row and training calls on plain ``F.linear``."""

import pytest
import torch

from stree.kernels import ops
from stree.kernels.linear import padded_linear


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
