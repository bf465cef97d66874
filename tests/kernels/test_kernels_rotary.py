"""The one-launch rotary kernel equals its reference (both layouts, partial rotary dim, strided views)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from stree.kernels.rotary import rotary_inv_freq, rotary_ref  # noqa: E402
from stree.kernels.rotary_triton import rotary_triton  # noqa: E402


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d, dim", [(16, 16), (16, 8), (12, 4)])
def test_rotary_kernel_matches_reference(interleaved, d, dim):
    g = torch.Generator().manual_seed(d + dim)
    qkv = torch.randn(2, 5, 3 * 3 * d, generator=g)
    x = qkv[..., 3 * d: 6 * d].reshape(2, 5, 3, d)  # a strided view, as attention's q/k are
    pos = torch.randint(0, 3000, (2, 5), generator=g)
    f = rotary_inv_freq(dim, 10000.0, "cpu")
    got, want = rotary_triton(x, pos, f, interleaved), rotary_ref(x, pos, f, interleaved)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_rotary_kernel_refuses_a_rotary_dim_past_the_head():
    with pytest.raises(ValueError, match="rotary dim"):
        rotary_triton(torch.randn(1, 2, 1, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(3), False)
