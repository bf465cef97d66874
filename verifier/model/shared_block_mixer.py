"""Zamba2's hybrid layer: a transformer block (attention over ``[hidden; embeddings]``, then an MLP) whose
linearly projected output joins the input of the layer's Mamba2 mixer.

``y = mamba(norm_m(h + linear(mlp(norm_ff(attn(norm_a([h; emb])))))))``, with ``h`` the residual stream
before the layer and ``emb`` the token embeddings. Zamba2 ties the transformer block's weights across
several layers and adds a per-layer LoRA adapter; the loader gives every use its own copy with the
adapter folded in, so each use is an ordinary attention layer with its own KV cache. The state keeps the
attention and Mamba2 halves' tensors in one flat record (``ParallelLayerState``), as ``ParallelMixer`` does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from stree.kernels import ops, rowwise

from stree.verifier.model.attention import Attention
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.linear import Linear
from stree.verifier.model.mamba2_mixer import Mamba2Mixer, MambaTreeActs
from stree.verifier.model.parallel_mixer import ParallelLayerState

MLP_ACTIVATIONS = {"gelu": rowwise.gelu, "silu": rowwise.silu}


def _rmsnorm(norm: nn.RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    return ops.add_rmsnorm(x, residual, norm.weight, norm.eps, False)[0]


class SharedBlockMixer(nn.Module):
    """Zamba2 hybrid layer (one use of the shared block, adapters folded) in every inference mode.

    Each mode takes ``h`` (the residual stream entering the layer) and ``emb`` (the token embeddings).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, eps, spec = config.d_model, config.norm_epsilon, config.hybrid_mlp
        self.attn_norm = nn.RMSNorm(2 * d, eps=eps)
        self.attn = Attention(config, d_in=2 * d)
        self.ff_norm = nn.RMSNorm(d, eps=eps)
        bias = bool(spec.get("bias", False))  # Zamba2's add_bias_linear
        self.gate_up_proj = Linear(d, 2 * int(spec["hidden"]), bias=bias)
        self.down_proj = Linear(int(spec["hidden"]), d, bias=bias)
        self.act = MLP_ACTIVATIONS[spec["act"]]
        self.linear = Linear(d, d, bias=False)
        self.mamba_norm = nn.RMSNorm(d, eps=eps)
        self.mamba = Mamba2Mixer(config)

    def new_state(self, batch: int, max_seqlen: int, device, dtype) -> ParallelLayerState:
        m = self.mamba.new_state(batch, device, dtype)
        a = self.attn.new_state(batch, max_seqlen, device, dtype)
        return ParallelLayerState(m.conv_state, m.ssm_state, a.k_cache, a.v_cache)

    def _attn_in(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return _rmsnorm(self.attn_norm, torch.cat([h, emb], dim=-1))

    def _mamba_in(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(_rmsnorm(self.ff_norm, attn_out)).chunk(2, dim=-1)
        t = self.linear(self.down_proj(self.act(gate) * up))
        return _rmsnorm(self.mamba_norm, t, h)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.mamba(self._mamba_in(h, self.attn(self._attn_in(h, emb))))

    def prefill(self, h, emb, state: ParallelLayerState, seqlen: torch.Tensor, lengths: torch.Tensor | None = None):
        a = self.attn.prefill(self._attn_in(h, emb), state, seqlen, lengths)
        return self.mamba.prefill(self._mamba_in(h, a), state, lengths)

    def step(self, h, emb, state: ParallelLayerState, seqlen: torch.Tensor) -> torch.Tensor:
        a = self.attn.step(self._attn_in(h, emb), state, seqlen)
        return self.mamba.step(self._mamba_in(h, a), state)

    def tree(self, h, emb, state: ParallelLayerState, seqlen, depth, anc_mask, parents):
        """Every node of a tree batch; returns the Mamba2 output and its replay activations."""
        a = self.attn.tree(self._attn_in(h, emb), state, seqlen, depth, anc_mask)
        return self.mamba.tree(self._mamba_in(h, a), state, parents)

    def commit(self, state: ParallelLayerState, acts: MambaTreeActs, seqlen, path, path_len) -> None:
        self.mamba.commit(state, acts, path, path_len)
        self.attn.commit(state, seqlen, path, path_len)
