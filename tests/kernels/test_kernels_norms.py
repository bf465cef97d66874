"""Fused norms (residual-add + RMSNorm, gated grouped RMSNorm): Triton kernels vs their references."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from stree.kernels.norms import add_rmsnorm_ref, gated_rmsnorm_ref  # noqa: E402
from stree.kernels.norms_triton import add_rmsnorm_triton, gated_rmsnorm_triton  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 24), (2, 5, 40)])
@pytest.mark.parametrize("has_res, fp32_res", [(False, True), (True, True), (True, False)])
def test_add_rmsnorm_matches_reference(shape, has_res, fp32_res):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    res = torch.randn(*shape, generator=g) if has_res else None
    w = torch.rand(shape[-1], generator=g) + 0.5
    out, r = add_rmsnorm_triton(x, res, w, 1e-5, fp32_res)
    want_out, want_r = add_rmsnorm_ref(x, res, w, 1e-5, fp32_res)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r, want_r, atol=1e-6, rtol=1e-6)
    assert r.dtype == (torch.float32 if fp32_res else x.dtype)


@pytest.mark.parametrize("groups, gs", [(1, 24), (3, 8), (2, 10)])
@pytest.mark.parametrize("before", [False, True])
def test_gated_rmsnorm_matches_reference(groups, gs, before):
    g = torch.Generator().manual_seed(groups * gs)
    y, z = torch.randn(2, 3, groups * gs, generator=g), torch.randn(2, 3, groups * gs, generator=g)
    w = torch.rand(groups * gs, generator=g) + 0.5
    out = gated_rmsnorm_triton(y, z, w, gs, 1e-5, before)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, gated_rmsnorm_ref(y, z, w, gs, 1e-5, before), atol=1e-5, rtol=1e-5)


def test_gated_rmsnorm_rejects_bad_group():
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        gated_rmsnorm_triton(torch.randn(2, 10), torch.randn(2, 10), torch.ones(10), 4, 1e-5)


def test_gated_rmsnorm_reads_a_column_slice_gate_in_place():
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(2, 3, 40, generator=g)  # like in_proj's output, z is a column slice of it
    y, z = torch.randn(2, 3, 16, generator=g), wide[..., 8:24]
    w = torch.rand(16, generator=g) + 0.5
    out = gated_rmsnorm_triton(y, z, w, 8, 1e-5)
    torch.testing.assert_close(out, gated_rmsnorm_ref(y, z, w, 8, 1e-5), atol=1e-5, rtol=1e-5)
