"""One-token decode step and prefill (our own Triton path) vs their references (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import rel_err  # noqa: E402
from stree.kernels.chunk_scan import conv_prefill_ref, ssd_prefill_ref  # noqa: E402
from stree.kernels.chunk_scan_triton import conv_prefill_triton, ssd_prefill_triton  # noqa: E402
from stree.kernels.decode_step import conv_step_ref, ssd_step_ref  # noqa: E402
from stree.kernels.decode_step_triton import conv_step_triton, ssd_step_triton  # noqa: E402


def test_ssd_step_matches_reference_and_updates_state():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, h, p, g, s = 3, 4, 24, 2, 16
    x = torch.randn(b, h, p, generator=gen)
    dt = torch.rand(b, h, generator=gen)
    A = -torch.rand(h, generator=gen)
    Bm, Cm = torch.randn(b, g, s, generator=gen), torch.randn(b, g, s, generator=gen)
    D = torch.randn(h, generator=gen)
    s1 = torch.randn(b, h, p, s, generator=gen)
    s2 = s1.clone()
    y1 = ssd_step_ref(s1, x, dt, A, Bm, Cm, D)
    y2 = torch.full_like(y1, float("nan"))
    ssd_step_triton(s2, x, dt, A, Bm, Cm, D, out=y2)
    assert rel_err(y2, y1) < 1e-5
    assert rel_err(s2, s1) < 1e-5


@pytest.mark.parametrize("width", [4, 1])
def test_conv_step_matches_reference_and_rolls_state(width):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, c = 2, 300  # two channel blocks
    state = torch.randn(b, c, width - 1, generator=gen)
    xbc = torch.randn(b, c, generator=gen)
    weight, bias = torch.randn(c, width, generator=gen), torch.randn(c, generator=gen)
    s1, s2 = state.clone(), state.clone()
    o1 = conv_step_ref(s1, xbc, weight, bias)
    o2 = torch.full_like(o1, float("nan"))
    conv_step_triton(s2, xbc, weight, bias, out=o2)
    assert rel_err(o2, o1) < 1e-5
    assert torch.equal(s2, s1)


@pytest.mark.parametrize("chunk,t", [(16, 37), (64, 70)])  # 64: fp32 chunks in 32-node tiles
def test_prefill_chunks_carry_the_state(chunk, t):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, h, p, g, s = 2, 2, 8, 1, 16
    x = torch.randn(b, t, h, p, generator=gen)
    dt = torch.rand(b, t, h, generator=gen) * 0.5
    A = -torch.rand(h, generator=gen)
    Bm, Cm = torch.randn(b, t, g, s, generator=gen), torch.randn(b, t, g, s, generator=gen)
    D = torch.randn(h, generator=gen)
    s1 = torch.randn(b, h, p, s, generator=gen)
    s2 = s1.clone()
    y1 = ssd_prefill_ref(x, dt, A, Bm, Cm, D, s1)
    y2 = ssd_prefill_triton(x, dt, A, Bm, Cm, D, s2, chunk_size=chunk, use_mamba_ssm=False)
    assert rel_err(y2, y1) < 1e-5
    assert rel_err(s2, s1) < 1e-5


def test_conv_prefill_matches_reference():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, t, c = 2, 9, 24
    xbc = torch.randn(b, t, c, generator=gen)
    state = torch.randn(b, c, 3, generator=gen)
    weight, bias = torch.randn(c, 4, generator=gen), torch.randn(c, generator=gen)
    s1, s2 = state.clone(), state.clone()
    o1 = conv_prefill_ref(xbc, s1, weight, bias)
    o2 = conv_prefill_triton(xbc, s2, weight, bias)
    assert rel_err(o2, o1) < 1e-5
    assert torch.equal(s2, s1)
