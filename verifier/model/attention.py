"""Multi-head attention with mamba_ssm's ``MHA`` parameter names: prefill, step and tree modes over a KV cache.

Tree K/V go into the cache slots after the committed ones; RoPE uses depth-based positions; after
verification ``commit`` moves the accepted nodes' K/V into contiguous slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from stree.kernels import ops, rowwise
from stree.kernels.backend import capturing

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.linear import Linear


@dataclass
class AttnLayerState:
    k_cache: torch.Tensor  # [B, L, Hkv, D]
    v_cache: torch.Tensor  # [B, L, Hkv, D]


class Attention(nn.Module):
    """Causal MHA/GQA; parameter names match mamba_ssm's ``MHA`` (``in_proj``, ``out_proj``)."""

    def __init__(self, config: ModelConfig, d_in: int | None = None):
        """``d_in``: the input width when it is not ``d_model`` (Zamba2 attends over ``[hidden; embeddings]``)."""
        super().__init__()
        cfg = config.attn
        self.num_heads = cfg["num_heads"]
        self.num_heads_kv = cfg["num_heads_kv"]
        self.head_dim = cfg["head_dim"]
        self.mlp_dim = cfg["mlp_dim"]
        self.rotary_dim = cfg["rotary_emb_dim"]
        self.rotary_base = cfg["rotary_emb_base"]
        self.rotary_interleaved = cfg["rotary_emb_interleaved"]
        self.softmax_scale = cfg["softmax_scale"]
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.in_proj = Linear(d_in or config.d_model, qkv_dim + self.mlp_dim, bias=cfg["qkv_proj_bias"])
        out_dim = self.head_dim * self.num_heads
        self.out_proj = Linear(out_dim + self.mlp_dim // 2, config.d_model, bias=cfg["out_proj_bias"])

    def new_state(self, batch: int, max_seqlen: int, device, dtype) -> AttnLayerState:
        shape = (batch, max_seqlen, self.num_heads_kv, self.head_dim)
        return AttnLayerState(torch.zeros(shape, device=device, dtype=dtype),
                              torch.zeros(shape, device=device, dtype=dtype))

    def _qkv(self, u: torch.Tensor, pos: torch.Tensor):
        proj = self.in_proj(u)
        qkv_dim = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        qkv, x_mlp = proj[..., :qkv_dim], proj[..., qkv_dim:]
        b, t = u.shape[:2]
        q = qkv[..., : self.num_heads * self.head_dim].reshape(b, t, self.num_heads, self.head_dim)
        kv = qkv[..., self.num_heads * self.head_dim:].reshape(b, t, 2, self.num_heads_kv, self.head_dim)
        k, v = kv[:, :, 0], kv[:, :, 1]
        q = ops.rotary(q, pos, self.rotary_dim, self.rotary_base, self.rotary_interleaved)
        k = ops.rotary(k, pos, self.rotary_dim, self.rotary_base, self.rotary_interleaved)
        return q, k, v, x_mlp

    def _out(self, ctx: torch.Tensor, x_mlp: torch.Tensor) -> torch.Tensor:
        ctx = ctx.reshape(*ctx.shape[:2], self.num_heads * self.head_dim)
        if self.mlp_dim > 0:
            up, gate = x_mlp.chunk(2, dim=-1)
            ctx = torch.cat([ctx, up * rowwise.silu(gate)], dim=-1)
        return self.out_proj(ctx)

    def _write(self, state: AttnLayerState, seqlen: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lengths: torch.Tensor | None = None) -> None:
        """K/V of position i into slot ``seqlen + i``. With ``lengths`` (right padding) a row's padding positions
        rewrite its last real slot with its last real K/V, so nothing lands past a row's end or the cache's."""
        b, t = k.shape[:2]
        cap = state.k_cache.shape[1]
        need = seqlen + (t if lengths is None else lengths)
        if not capturing() and int(need.max()) > cap:
            raise ValueError(f"KV cache of {cap} slots is full (need {int(need.max())})")
        idx = torch.arange(t, device=k.device)[None, :].expand(b, t)
        rows = torch.arange(b, device=k.device)[:, None].expand(b, t)
        if lengths is not None:
            idx = torch.minimum(idx, lengths[:, None] - 1)
            k, v = k[rows, idx], v[rows, idx]
        slots = seqlen[:, None] + idx
        state.k_cache[rows, slots] = k.to(state.k_cache.dtype)
        state.v_cache[rows, slots] = v.to(state.v_cache.dtype)

    def _attend(self, u, state, seqlen, pos, anc_mask, lengths=None, is_chain: bool = False):
        q, k, v, x_mlp = self._qkv(u, pos)
        self._write(state, seqlen, k, v, lengths)
        ctx = ops.tree_attention(q, state.k_cache, state.v_cache, seqlen, anc_mask, self.softmax_scale,
                                 is_chain=is_chain)
        return self._out(ctx, x_mlp)

    # ----- modes ----------------------------------------------------------------------------
    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Whole sequences without a cache (training and scoring)."""
        b, t = u.shape[:2]
        pos = torch.arange(t, device=u.device)[None].expand(b, t)
        q, k, v, x_mlp = self._qkv(u, pos)
        rep = self.num_heads // self.num_heads_kv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        ctx = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.softmax_scale
        ).transpose(1, 2)
        return self._out(ctx, x_mlp)

    def prefill(self, u, state: AttnLayerState, seqlen: torch.Tensor, lengths: torch.Tensor | None = None):
        """T tokens after the cached ones; with ``lengths`` only row b's first ``lengths[b]`` are real (right
        padding): real positions never see padding under the causal mask, and padding K/V are not cached."""
        b, t = u.shape[:2]
        ar = torch.arange(t, device=u.device)
        chain = (ar[None, :] <= ar[:, None])[None].expand(b, t, t)
        return self._attend(u, state, seqlen, seqlen[:, None] + ar[None, :], chain, lengths, is_chain=True)

    def step(self, u, state: AttnLayerState, seqlen: torch.Tensor) -> torch.Tensor:
        one = torch.ones(u.shape[0], 1, 1, dtype=torch.bool, device=u.device)
        return self._attend(u[:, None], state, seqlen, seqlen[:, None], one, is_chain=True)[:, 0]

    def tree(self, u, state: AttnLayerState, seqlen, depth, anc_mask):
        return self._attend(u, state, seqlen, seqlen[:, None] + depth, anc_mask)

    def commit(self, state: AttnLayerState, seqlen, path, path_len) -> None:
        ops.kv_commit(state.k_cache, state.v_cache, seqlen, path, path_len)
