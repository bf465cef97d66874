"""The training forward and losses against the model's own forward and plain PyTorch: values and gradients.

The chunked SSD (every chunk at once) against the one-chunk-after-another reference; the training forward's
logits against ``StreeLM.forward`` on our hybrid and on Hugging Face hybrids (MLP after every mixer, per-token
layers, muP multipliers); the row-block cross-entropy and KL against materialised logits; FLOP counting.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_helpers import BUILDERS, save_tiny

from stree.kernels import backend
from stree.kernels.chunk_scan import ssd_prefill_ref
from stree.training.fast_forward import TrainForward, head
from stree.training.flops import forward_flops_per_token, matmul_params, train_flops_per_token
from stree.training.losses import draft_stats, linear_cross_entropy, linear_kl
from stree.training.ssd import ssd_chunked_ref, ssd_train
from stree.verifier.model.checkpoint import load_model


@pytest.fixture(autouse=True)
def _torch_backend():
    backend.use("torch")  # as training runs: the differentiable references outside the fast path
    yield
    backend.use(None)


@pytest.mark.parametrize("t,chunk,groups", [(37, 16, 1), (64, 16, 2), (20, 64, 2)])
def test_chunked_ssd_matches_the_sequential_reference_and_its_gradients(t, chunk, groups):
    b, h, p, n = 2, 4, 4, 8
    x = torch.randn(b, t, h, p, requires_grad=True)
    dt = (torch.rand(b, t, h) * 0.4 + 0.01).requires_grad_()
    A = (-torch.rand(h) * 3 - 0.1).requires_grad_()
    Bm = torch.randn(b, t, groups, n, requires_grad=True)
    Cm = torch.randn(b, t, groups, n, requires_grad=True)
    D = torch.randn(h, requires_grad=True)
    got = ssd_chunked_ref(x, dt, A, Bm, Cm, D, chunk_size=chunk)
    want = ssd_prefill_ref(x, dt, A, Bm, Cm, D, torch.zeros(b, h, p, n), chunk_size=chunk)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    gy = torch.randn_like(got)
    inputs = [x, dt, A, Bm, Cm, D]
    for g1, g2 in zip(torch.autograd.grad(got, inputs, gy), torch.autograd.grad(want, inputs, gy)):
        torch.testing.assert_close(g1, g2, atol=2e-3, rtol=1e-3)


def test_ssd_train_applies_softplus_bias_and_limit():
    b, t, h, p, n = 1, 9, 2, 4, 8
    x, dt_raw = torch.randn(b, t, h, p), torch.randn(b, t, h)
    A, D, bias = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
    Bm, Cm = torch.randn(b, t, 1, n), torch.randn(b, t, 1, n)
    dt = F.softplus(dt_raw + bias).clamp(0.05, 0.5)
    torch.testing.assert_close(ssd_train(x, dt_raw, A, Bm, Cm, D, bias, (0.05, 0.5)),
                               ssd_chunked_ref(x, dt, A, Bm, Cm, D), atol=1e-5, rtol=1e-5)


def _check_forward_and_grads(model, vocab: int, t: int = 21):
    x = torch.randint(0, vocab, (2, t + 1))
    want_logits = model(x[:, :-1]).float()
    fwd = TrainForward(model)
    h = fwd(x[:, :-1])
    w, scale = head(model)
    torch.testing.assert_close(F.linear(h, w).float() * scale, want_logits, atol=2e-4, rtol=2e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    loss = linear_cross_entropy(h, w, x[:, 1:], scale, rows=7)
    got = torch.autograd.grad(loss, params, allow_unused=True)
    ref = F.cross_entropy(model(x[:, :-1]).reshape(-1, vocab).float(), x[:, 1:].reshape(-1))
    want = torch.autograd.grad(ref, params, allow_unused=True)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for g1, g2 in zip(got, want):
        if g2 is not None:
            torch.testing.assert_close(g1, g2, atol=2e-4, rtol=2e-3)


def test_training_forward_matches_the_model_forward(models):
    _check_forward_and_grads(models["hybrid"], 64)
    _check_forward_and_grads(models["mamba2"], 64)


@pytest.mark.parametrize("family", ["bamba", "nemotron_h", "falcon_h1"])
def test_training_forward_matches_hf_hybrids(family, tmp_path):
    model = load_model(save_tiny(BUILDERS[family](), tmp_path / family), dtype=torch.float32)
    _check_forward_and_grads(model, model.vocab_size)


def test_row_block_losses_match_materialised_logits():
    h = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (3, 5))
    t_h, t_w = torch.randn(3, 5, 8), torch.randn(40, 8)
    ce = linear_cross_entropy(h, w, y, scale=0.7, rows=4)
    ce_ref = F.cross_entropy((h @ w.t() * 0.7).reshape(-1, 40), y.reshape(-1))
    t_logp = F.log_softmax(t_h @ t_w.t() * 1.3, -1)
    d_logp = F.log_softmax(h @ w.t() * 0.7, -1)
    kl = linear_kl(h, w, t_h, t_w, 0.7, 1.3, rows=6)
    kl_ref = (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()
    for got, want in ((ce, ce_ref), (kl, kl_ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g1, g2 in zip(torch.autograd.grad(got, [h, w]), torch.autograd.grad(want, [h, w])):
            torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    stats = draft_stats(h, w, t_h, t_w, y, 0.7, 1.3, rows=4)
    assert stats["n"] == 15
    assert stats["kl"] / 15 == pytest.approx(kl_ref.item(), rel=1e-5)
    assert stats["ce"] / 15 == pytest.approx(ce_ref.item(), rel=1e-5)
    assert stats["top1"] == float((d_logp.argmax(-1) == t_logp.argmax(-1)).sum())
    with pytest.raises(ValueError, match="draft head has 40 tokens, the target's 41"):
        linear_kl(h, w, t_h, torch.randn(41, 8))


def test_flops_count_the_matrices_attention_and_ssd(models):
    m = models["hybrid"]  # 3 layers d 32 (attention at 1), d_state 8, headdim 8, vocab 64, tied embedding
    d, vocab, t = 32, 64, 100
    mix = m.backbone.layers[0].mixer
    in_proj = d * (2 * 2 * d + 2 * 8 + mix.nheads)
    attn = m.backbone.layers[1].mixer
    attn_params = attn.in_proj.weight.numel() + attn.out_proj.weight.numel()
    assert matmul_params(m) == 2 * (in_proj + 2 * d * d) + attn_params + vocab * d
    ssd = 1 * t * 8 + mix.nheads * t * 8 + 4 * mix.nheads * 8 * 8  # one group, chunk = t (< 256)
    want = 2 * matmul_params(m) + 2 * ssd + 2 * t * attn.num_heads * attn.head_dim  # two Mamba2 layers
    assert forward_flops_per_token(m, t) == want
    assert train_flops_per_token(m, t) == 3 * want


@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_reach_every_parameter_whatever_kernel_backend_is_forced(recompute):
    """With the Triton backend forced (the GPU's default), the training forward still runs its model ops' references
    while gradients are on, in the forward and in a recomputed block, so the backward pass reaches every layer."""
    from stree.training.model_shape import Shape, make_model

    model = make_model(Shape(32, 3, (1,), 16, 16), 50, 0, "cpu")
    x = torch.randint(0, 50, (2, 17))
    backend.use("triton")  # the interpreter runs it on the CPU; a Triton op has no backward
    fwd = TrainForward(model, recompute=recompute)
    w, scale = head(model)
    linear_cross_entropy(fwd(x[:, :-1]), w, x[:, 1:], scale).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert backend.resolve("cpu") == "triton"  # the forced backend is back after the forward
