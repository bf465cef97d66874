"""The exact numerics' GEMM (``gemm_ref`` and ``gemm_triton`` on the CPU interpreter, fp32): close to ``F.linear``,
and every row bit-for-bit the same alone, inside blocks of other rows and at other offsets; GEMMs that choose their
reduction by the row count fail the same check."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from invariance_helpers import row_failures  # noqa: E402
from stree.kernels.gemm import GEMM_ROWS, gemm_ref  # noqa: E402
from stree.kernels.gemm_triton import gemm_config, gemm_triton  # noqa: E402


def _case(gen, m, k, n, bias):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    return x, w, b


@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 40, False), (5, 96, 24, True), (GEMM_ROWS + 3, 256, 64, True)])
def test_gemm_ref_is_close_to_f_linear_and_row_invariant(m, k, n, bias):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, w, b = _case(gen, m, k, n, bias)
    torch.testing.assert_close(gemm_ref(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert row_failures(lambda t: gemm_ref(t, w, b), x, gen=gen) == 0
    assert gemm_ref(x[None, :, None], w, b).shape == (1, m, 1, n)


@pytest.mark.parametrize("m,k,n,bias,split", [(3, 64, 40, True, None), (9, 96, 24, False, 2)])
def test_gemm_triton_is_close_to_f_linear_and_row_invariant(m, k, n, bias, split):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, w, b = _case(gen, m, k, n, bias)
    knobs = {} if split is None else {"split_k": split}

    def gemm(t):
        return gemm_triton(t, w, b, **knobs)

    torch.testing.assert_close(gemm(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert row_failures(gemm, x, blocks=(1, 40), gen=gen, picks=2) == 0
    xt = torch.randn(k, 2 * m, generator=gen).t()[::2]  # a strided input
    torch.testing.assert_close(gemm(xt), F.linear(xt, w, b), atol=1e-5, rtol=1e-5)


def test_gemm_triton_split_k_runs_twice_with_the_counters_reset():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, w, b = _case(gen, 4, 128, 32, True)
    first = gemm_triton(x, w, b, split_k=4)
    assert torch.equal(gemm_triton(x, w, b, split_k=4), first)
    torch.testing.assert_close(first, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_gemm_config_fills_the_gpu_from_the_weight_shape_alone():
    """``gemm_config`` sees no row count; at the Mamba2-2.7B shapes a one-row GEMV still reaches every SM."""
    for n, k in ((2560, 5120), (10576, 2560), (50288, 2560)):
        cfg = gemm_config(n, k, torch.bfloat16, 132)
        assert -(-n // cfg["block_n"]) * cfg["split_k"] >= 132
        assert cfg["block_m"] == gemm_config(n + 7, k, torch.bfloat16, 132)["block_m"]
    assert gemm_config(2560, 5120, torch.bfloat16, 132)["split_k"] > 1
    assert gemm_config(50288, 2560, torch.bfloat16, 132)["split_k"] == 1


def test_planted_non_invariant_gemms_fail_the_check():
    """The check is not vacuous: F.linear on the raw row count (MKL's gemv for one row, gemm for more) and a Triton
    GEMM whose K chunk follows the row count both give some row other bits alone than in a block."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    raw, by_rows = 0, 0
    for _ in range(3):
        x, w, b = _case(gen, 20, 256, 64, False)
        raw += row_failures(lambda t: F.linear(t, w), x, gen=gen)
        by_rows += row_failures(lambda t: gemm_triton(t, w, block_k=16 if t.shape[0] < 8 else 64), x[:6],
                                blocks=(1, 9), gen=gen, picks=2)
    assert raw > 0 and by_rows > 0
