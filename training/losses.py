"""Losses read through the LM head a block of rows at a time: logits of every position are never held at once.

``linear_cross_entropy`` (next-token cross-entropy) and ``linear_kl`` (KL(target || draft) over the target's
whole softmax, for distillation) take final-norm hidden states and the head's weight. Their forward pass computes
each row block's logits in float32, its loss and, when a gradient is wanted, the gradients with respect to the
hidden states and the weight at once (the softmax is the gradient), then drops the block's logits; the backward
pass only scales the stored gradients. Peak extra memory is one ``[rows, V]`` float32 block, not ``[B*T, V]``.
The matrix products run in the autocast dtype where autocast is on (bf16 on CUDA), in float32 otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_BYTES = 1 << 28  # one row block's float32 logits: 256 MiB


def block_rows(vocab: int) -> int:
    return max(1, BLOCK_BYTES // (4 * vocab))


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


def _row_blocks(ctx, h, w, rows: int, cdtype, block) -> torch.Tensor:
    """The mean over rows of ``block(start, h rows, w)`` -> ``(loss sum, d loss / d logits or None)``, and the
    gradients w.r.t. ``h`` and ``w`` that those logit gradients give (stored on ``ctx`` for the backward pass)."""
    with torch.autocast(h.device.type, enabled=False):
        n = h.shape[0]
        hc, wc = h.to(cdtype), w.to(cdtype)
        grad_h = torch.empty_like(hc) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, rows):
            hs = hc[s:s + rows]
            loss, g = block(s, hs, wc, grad_h is not None or grad_w is not None)
            total += loss
            if g is None:
                continue
            g = (g / n).to(cdtype)
            if grad_h is not None:
                grad_h[s:s + rows] = g @ wc
            if grad_w is not None:
                grad_w += (g.t() @ hs).float()
    ctx.save_for_backward(grad_h, grad_w)
    ctx.dtypes = (h.dtype, w.dtype)
    return total / n


class _StoredGradients(torch.autograd.Function):
    """The forward pass (``_row_blocks``) already computed the gradients; the backward pass scales them."""

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else (grad_h * grad_out).to(ctx.dtypes[0])
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[1])
        return (gh, gw) + (None,) * (len(ctx.needs_input_grad) - 2)


class _LinearCrossEntropy(_StoredGradients):
    @staticmethod
    def forward(ctx, h, w, targets, scale: float, rows: int, cdtype):
        def block(s, hs, wc, want_grad):
            ts = targets[s:s + rows]
            logits = F.linear(hs, wc).float() * scale
            lse = torch.logsumexp(logits, -1)
            loss = (lse - logits.gather(1, ts[:, None])[:, 0]).sum()
            if not want_grad:
                return loss, None
            g = torch.exp(logits - lse[:, None])  # softmax: d(lse - logit_t)/d logits = p - onehot(t)
            g[torch.arange(len(ts), device=g.device), ts] -= 1.0
            return loss, g * scale

        return _row_blocks(ctx, h, w, rows, cdtype, block)


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, scale: float = 1.0,
                         rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``logits = scale * h @ w.T`` (``h`` ``[..., d]``, ``w`` ``[V, d]``) against ``targets``."""
    h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    return _LinearCrossEntropy.apply(h2, w, t, float(scale), rows or block_rows(w.shape[0]), _compute_dtype(h))


class _LinearKL(_StoredGradients):
    @staticmethod
    def forward(ctx, h, w, t_h, t_w, scale: float, t_scale: float, rows: int, cdtype):
        thc, twc = t_h.to(cdtype), t_w.to(cdtype)

        def block(s, hs, wc, want_grad):
            t_logp = F.log_softmax(F.linear(thc[s:s + rows], twc).float() * t_scale, -1)
            d_logp = F.log_softmax(F.linear(hs, wc).float() * scale, -1)
            p_t = t_logp.exp()
            loss = (p_t * (t_logp - d_logp)).sum()
            return loss, ((d_logp.exp() - p_t) * scale) if want_grad else None  # d KL / d draft logits

        return _row_blocks(ctx, h, w, rows, cdtype, block)


def linear_kl(h: torch.Tensor, w: torch.Tensor, t_h: torch.Tensor, t_w: torch.Tensor, scale: float = 1.0,
              t_scale: float = 1.0, rows: int | None = None) -> torch.Tensor:
    """Mean KL(target || draft) per position: target logits ``t_scale * t_h @ t_w.T`` (no gradient), draft logits
    ``scale * h @ w.T`` (``h``/``t_h`` ``[..., d]`` of the same positions, both heads ``[V, d]`` of one vocabulary)."""
    if t_w.shape[0] != w.shape[0]:
        raise ValueError(f"linear_kl: the draft head has {w.shape[0]} tokens, the target's {t_w.shape[0]}")
    h2, t2 = h.reshape(-1, h.shape[-1]), t_h.reshape(-1, t_h.shape[-1]).detach()
    return _LinearKL.apply(h2, w, t2, t_w.detach(), float(scale), float(t_scale), rows or block_rows(w.shape[0]),
                           _compute_dtype(h))


@torch.no_grad()
def draft_stats(h, w, t_h, t_w, targets, scale: float = 1.0, t_scale: float = 1.0, rows: int | None = None) -> dict:
    """Sums over positions, for validation: ``kl`` (target || draft), ``ce`` (the draft's cross-entropy on
    ``targets``), ``top1`` (positions where the draft's argmax is the target's), and ``n``."""
    h2, t2, y = h.reshape(-1, h.shape[-1]), t_h.reshape(-1, t_h.shape[-1]), targets.reshape(-1)
    cd = _compute_dtype(h)
    rows = rows or block_rows(w.shape[0])
    kl = ce = top1 = 0.0
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h2.shape[0], rows):
            t_logp = F.log_softmax(F.linear(t2[s:s + rows].to(cd), t_w.to(cd)).float() * t_scale, -1)
            d_logp = F.log_softmax(F.linear(h2[s:s + rows].to(cd), w.to(cd)).float() * scale, -1)
            kl += float((t_logp.exp() * (t_logp - d_logp)).sum())
            ce -= float(d_logp.gather(1, y[s:s + rows, None]).sum())
            top1 += float((d_logp.argmax(-1) == t_logp.argmax(-1)).sum())
    return {"kl": kl, "ce": ce, "top1": top1, "n": h2.shape[0]}
