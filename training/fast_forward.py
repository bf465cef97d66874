"""The training forward of a StreeLM: the final-norm hidden states, by the same math as ``StreeLM.forward``.

A Mamba2 block whose mixer is a plain ``Mamba2Mixer`` runs as three pieces: ``mamba_in`` (residual add, RMSNorm,
in_proj, causal depthwise conv, SiLU), the SSD (``training.ssd.ssd_train``: mamba_ssm's chunked Triton kernels
where installed) and ``mamba_out`` (D skip, gated RMSNorm, out_proj). The two pieces around the SSD are plain
functions of tensors, so ``torch.compile`` (``compile=True``) fuses their elementwise work once for every layer of
one shape; uncompiled on CUDA, the gated RMSNorm is mamba_ssm's Triton kernel (forward and backward, keeping only its
inputs for the backward pass) where installed. Every other block (attention, MLP/MoE layers, the Hugging Face
families' composite mixers) runs its module's own forward, which is differentiable through the PyTorch references
(``stree.kernels.backend``). The LM head is left to the loss (``training.losses``), which never materialises every
position's logits at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from stree.kernels import backend
from stree.kernels.mamba_ssm_import import mamba_ssm_attr
from stree.verifier.model.lm import Block, StreeLM
from stree.verifier.model.mamba2_mixer import Mamba2Mixer

from stree.training.ssd import ssd_train


@dataclass(frozen=True)
class MambaDims:
    """A Mamba2 mixer's static sizes and options (hashable, so a compiled piece specialises on it)."""

    d_mlp: int
    d_ssm: int
    conv_dim: int
    nheads: int
    headdim: int
    ngroups: int
    d_state: int
    residual_in_fp32: bool
    norm_eps: float
    rmsnorm: bool
    group_size: int
    gnorm_eps: float
    norm_before_gate: bool
    D_has_hdim: bool
    residual_multiplier: float

    @staticmethod
    def of(block: Block) -> "MambaDims":
        m = block.mixer
        norm = getattr(m, "norm", None)
        return MambaDims(m.d_mlp, m.d_ssm, m.conv_dim, m.nheads, m.headdim, m.ngroups, m.d_state,
                         block.residual_in_fp32, block.norm.eps, m.rmsnorm,
                         norm.group_size if norm is not None else m.d_ssm, norm.eps if norm is not None else 0.0,
                         norm.norm_before_gate if norm is not None else False, m.D_has_hdim,
                         block.residual_multiplier)


def fast_mamba(block: Block) -> bool:
    """Whether ``block`` runs as ``mamba_in`` / SSD / ``mamba_out``: a plain Mamba2 mixer (SiLU) after an RMSNorm."""
    return (type(block.mixer) is Mamba2Mixer and isinstance(block.norm, nn.RMSNorm)
            and getattr(block.mixer, "activation", "silu") in ("silu", "swish"))


def mamba_in(hidden, residual, norm_w, in_w, in_b, conv_w, conv_b, dims: MambaDims):
    """Residual add + RMSNorm + in_proj + causal conv + SiLU: ``(new residual, z0, x0, z, x, B, C, dt_raw)``."""
    res = hidden.float() if residual is None else hidden.float() + residual.float()
    normed = (F.rms_norm(res, (res.shape[-1],), eps=dims.norm_eps) * norm_w.float()).to(hidden.dtype)
    zxbcdt = F.linear(normed, in_w, in_b)
    z0, x0, z, xBC, dt_raw = torch.split(
        zxbcdt, [dims.d_mlp, dims.d_mlp, dims.d_ssm, dims.conv_dim, dims.nheads], dim=-1)
    t, width = xBC.shape[1], conv_w.shape[-1]
    xbc = F.conv1d(xBC.transpose(1, 2), conv_w, conv_b, padding=width - 1, groups=dims.conv_dim)[..., :t]
    xbc = F.silu(xbc).transpose(1, 2)
    gs = dims.ngroups * dims.d_state
    x, Bm, Cm = torch.split(xbc, [dims.d_ssm, gs, gs], dim=-1)
    b = x.shape[0]
    x = x.reshape(b, t, dims.nheads, dims.headdim)
    Bm = Bm.reshape(b, t, dims.ngroups, dims.d_state)
    Cm = Cm.reshape(b, t, dims.ngroups, dims.d_state)
    res = res if dims.residual_in_fp32 else res.to(hidden.dtype)
    return res, z0, x0, z, x, Bm, Cm, dt_raw


def mamba_out(y, x, z, z0, x0, D, gnorm_w, out_w, out_b, dims: MambaDims):
    """D skip (per channel), gated RMSNorm (or SiLU gate), the MLP half of in_proj, out_proj."""
    b, t = y.shape[:2]
    y = y.reshape(b, t, dims.d_ssm)
    if dims.D_has_hdim:
        y = y + x.reshape(b, t, dims.d_ssm) * D.to(y.dtype)
    if dims.rmsnorm:
        yf, zf = y.float(), z.float()
        g = yf if dims.norm_before_gate else yf * F.silu(zf)
        g = F.rms_norm(g.reshape(b, t, -1, dims.group_size), (dims.group_size,), eps=dims.gnorm_eps)
        g = g.reshape(b, t, dims.d_ssm) * gnorm_w.float()
        if dims.norm_before_gate:
            g = g * F.silu(zf)
        y = g.to(z.dtype)
    else:
        y = y * F.silu(z)
    if dims.d_mlp > 0:
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    out = F.linear(y, out_w, out_b)
    return out if dims.residual_multiplier == 1.0 else out * dims.residual_multiplier


class TrainForward:
    """The final-norm hidden states of one model (call it on ids), its pieces optionally compiled and its blocks
    optionally recomputed in the backward pass (activation checkpointing: less memory, a third more compute).
    ``use_kernel=False`` keeps mamba_ssm's kernels out (the PyTorch path everywhere)."""

    def __init__(self, model: StreeLM, compile: bool = False, recompute: bool = False, use_kernel: bool = True):
        self.model, self.recompute, self.use_kernel = model, recompute, use_kernel
        self.pre, self.post = mamba_in, mamba_out
        self.gated_norm = None  # mamba_ssm's gated RMSNorm kernel (eager CUDA runs only)
        if compile:
            self.pre, self.post = torch.compile(mamba_in, dynamic=False), torch.compile(mamba_out, dynamic=False)
        elif use_kernel:
            self.gated_norm = mamba_ssm_attr("ops.triton.layernorm_gated", "rmsnorm_fn")
        self.dims = {i: MambaDims.of(b) for i, b in enumerate(model.backbone.layers) if fast_mamba(b)}

    def _mamba_block(self, block: Block, dims: MambaDims, hidden, residual):
        m = block.mixer
        res, z0, x0, z, x, Bm, Cm, dt_raw = self.pre(hidden, residual, block.norm.weight, m.in_proj.weight,
                                                     m.in_proj.bias, m.conv1d.weight, m.conv1d.bias, dims)
        D = m.D if not m.D_has_hdim else torch.zeros(m.nheads, device=x.device)
        A = -torch.exp(m.A_log.float())
        y = ssd_train(x, dt_raw, A, Bm, Cm, D, m.dt_bias, m.dt_limit, self.use_kernel)
        if self.gated_norm is not None and y.is_cuda and dims.rmsnorm and not dims.D_has_hdim and not dims.d_mlp:
            b, t = y.shape[:2]
            y = self.gated_norm(y.reshape(b, t, dims.d_ssm), m.norm.weight, None, z=z, eps=dims.gnorm_eps,
                                group_size=dims.group_size, norm_before_gate=dims.norm_before_gate)
            out = F.linear(y, m.out_proj.weight, m.out_proj.bias)
            out = out if dims.residual_multiplier == 1.0 else out * dims.residual_multiplier
        else:
            gnorm_w = m.norm.weight if m.rmsnorm else None
            out = self.post(y, x, z, z0, x0, m.D, gnorm_w, m.out_proj.weight, m.out_proj.bias, dims)
        if block.mlp is None:
            return out, res
        normed, res = block._add_norm(block.norm2, out, res)
        return block._scaled(block.mlp(normed)), res

    @staticmethod
    def _differentiable_ops():
        """With gradients on, the model's own ops run their differentiable PyTorch references (a Triton op would
        cut the backward pass), whatever kernel backend is set; without them, the backend as set."""
        return backend.using("torch") if torch.is_grad_enabled() else contextlib.nullcontext()

    def _block(self, i: int, block: Block, hidden, residual, emb):
        with self._differentiable_ops():  # also when activation checkpointing recomputes the block backward
            if i in self.dims:
                return self._mamba_block(block, self.dims[i], hidden, residual)
            return block.run(hidden, residual, block.mixer, emb)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ids -> ``[B, T, d]`` final-norm hidden states (the LM head's input)."""
        model = self.model
        hidden, residual = model.backbone.embedding(input_ids), None
        if model.config.embedding_multiplier != 1.0:
            hidden = hidden * model.config.embedding_multiplier
        emb = hidden
        for i, block in enumerate(model.backbone.layers):
            if self.recompute and torch.is_grad_enabled():
                hidden, residual = checkpoint(self._block, i, block, hidden, residual, emb, use_reentrant=False)
            else:
                hidden, residual = self._block(i, block, hidden, residual, emb)
        with self._differentiable_ops():
            h, _ = model.backbone.layers[-1]._add_norm(model.backbone.norm_f, hidden, residual)
        return h


def head(model: StreeLM) -> tuple[torch.Tensor, float]:
    """The LM head's weight over the real vocabulary ``[V, d]`` and the factor its logits are multiplied by."""
    return model.lm_head.weight[: model.config.vocab_size], 1.0 / model.config.logits_scaling
