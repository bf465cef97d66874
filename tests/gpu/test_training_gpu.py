"""GPU: the training forward with mamba_ssm's kernels (SSD, gated RMSNorm) where installed, and compiled, against
the PyTorch path and the model's own forward; the row-block losses under bf16 autocast; a short training phase
that lowers the loss with CUDA graphs. Correctness only, no timing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stree.kernels import backend
from stree.training.fast_forward import TrainForward, head
from stree.training.losses import linear_cross_entropy, linear_kl
from stree.training.loop import PhaseConfig, run_phase
from stree.training.model_shape import Shape, make_model
from stree.training.ssd import ssd_backend, ssd_chunked_ref, ssd_train, softplus_dt
from stree.training.train import lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _torch_backend():
    backend.use("torch")
    yield
    backend.use(None)


def _model(seed: int = 0):
    return make_model(Shape(256, 4, (2,), 64, 64), 1000, seed, "cuda")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_ssd_train_kernel_matches_the_reference_with_gradients():
    torch.manual_seed(0)
    b, t, h, p, g, n = 2, 300, 8, 64, 2, 64
    x = torch.randn(b, t, h, p, device="cuda", requires_grad=True)
    dt_raw = torch.randn(b, t, h, device="cuda", requires_grad=True)
    A = (-torch.rand(h, device="cuda") - 0.5).requires_grad_()
    Bm = torch.randn(b, t, g, n, device="cuda", requires_grad=True)
    Cm = torch.randn(b, t, g, n, device="cuda", requires_grad=True)
    D = torch.randn(h, device="cuda", requires_grad=True)
    bias = torch.randn(h, device="cuda", requires_grad=True)
    got = ssd_train(x, dt_raw, A, Bm, Cm, D, bias, (0.0, float("inf")))
    want = ssd_chunked_ref(x, softplus_dt(dt_raw, bias, (0.0, float("inf"))), A, Bm, Cm, D)
    assert _rel(got, want) < 1e-2  # mamba_ssm's fp32 products are tf32
    gy = torch.randn_like(want)
    inputs = [x, dt_raw, A, Bm, Cm, D, bias]
    for g1, g2 in zip(torch.autograd.grad(got, inputs, gy), torch.autograd.grad(want, inputs, gy)):
        assert _rel(g1, g2) < 2e-2
    print("SSD backend:", ssd_backend("cuda"))


@pytest.mark.parametrize("compile", [False, True])
def test_training_forward_matches_the_model_and_the_pytorch_path(compile):
    model = _model()
    x = torch.randint(0, 1000, (2, 257), device="cuda")
    want = model(x[:, :-1])
    fast = TrainForward(model, compile=compile)
    plain = TrainForward(model, use_kernel=False)
    w, scale = head(model)
    assert _rel(F.linear(fast(x[:, :-1]), w) * scale, want) < 1e-2
    params = [p for p in model.parameters()]
    g_fast = torch.autograd.grad(lm_loss(fast, x), params)
    g_plain = torch.autograd.grad(lm_loss(plain, x), params)
    for g1, g2 in zip(g_fast, g_plain):
        assert _rel(g1, g2) < 3e-2


def test_bf16_losses_track_fp32():
    model = _model(1)
    x = torch.randint(0, 1000, (4, 129), device="cuda")
    fwd = TrainForward(model)
    fp32 = float(lm_loss(fwd, x))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = float(lm_loss(fwd, x))
        h = fwd(x[:, :-1])
        w, scale = head(model)
        kl_self = float(linear_kl(h, w, h.detach(), w.detach(), scale, scale))
        ce = float(linear_cross_entropy(h, w, x[:, 1:], scale, rows=100))
    assert bf16 == pytest.approx(fp32, rel=2e-2) and ce == pytest.approx(bf16, rel=1e-3)
    assert abs(kl_self) < 1e-3


def test_a_short_phase_lowers_the_loss_with_cuda_graphs():
    model = _model(2)
    fwd = TrainForward(model)
    data = torch.randint(0, 50, (64, 129), device="cuda")  # a small vocabulary in use: quick to learn
    res = run_phase(model, lambda x: lm_loss(fwd, x), lambda s: data[(s * 8) % 64:(s * 8) % 64 + 8],
                    PhaseConfig(steps=30, lr=3e-3, warmup=3, eval_every=100, tokens_per_step=8 * 128,
                                flops_per_token=1.0), "cuda")
    assert res.losses[-1][1] < res.losses[0][1] - 1.0
    assert res.tokens_per_s and res.tokens_per_s > 0
    print("graphed:", res.graphed, res.note)
