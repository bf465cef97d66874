"""A Mamba2 mixer and an attention layer side by side on the same normed input, outputs summed (Falcon-H1).

Each half runs its own prefill / step / tree / commit code unchanged; the layer's state holds both
halves' tensors in one flat record, so every generic state copy (clone, select, CUDA-graph buffers)
sees four tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from stree.verifier.model.attention import Attention
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.mamba2_mixer import Mamba2Mixer, MambaTreeActs


@dataclass
class ParallelLayerState:
    """A MambaLayerState's and an AttnLayerState's fields in one record (each half reads its own)."""

    conv_state: torch.Tensor  # [B, C, K-1]
    ssm_state: torch.Tensor  # [B, H, P, S] float32
    k_cache: torch.Tensor  # [B, L, Hkv, D]
    v_cache: torch.Tensor  # [B, L, Hkv, D]


class ParallelMixer(nn.Module):
    """``mamba(u) + attn(u)`` in every inference mode."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.mamba = Mamba2Mixer(config)
        self.attn = Attention(config)

    def new_state(self, batch: int, max_seqlen: int, device, dtype) -> ParallelLayerState:
        m = self.mamba.new_state(batch, device, dtype)
        a = self.attn.new_state(batch, max_seqlen, device, dtype)
        return ParallelLayerState(m.conv_state, m.ssm_state, a.k_cache, a.v_cache)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.mamba(u) + self.attn(u)

    def prefill(self, u, state: ParallelLayerState, seqlen: torch.Tensor, lengths: torch.Tensor | None = None):
        return self.mamba.prefill(u, state, lengths) + self.attn.prefill(u, state, seqlen, lengths)

    def step(self, u, state: ParallelLayerState, seqlen: torch.Tensor) -> torch.Tensor:
        return self.mamba.step(u, state) + self.attn.step(u, state, seqlen)

    def tree(self, u, state: ParallelLayerState, seqlen, depth, anc_mask, parents):
        """Every node of a tree batch; returns the summed output and the Mamba half's replay activations."""
        y, acts = self.mamba.tree(u, state, parents)
        return y + self.attn.tree(u, state, seqlen, depth, anc_mask), acts

    def commit(self, state: ParallelLayerState, acts: MambaTreeActs, seqlen, path, path_len) -> None:
        self.mamba.commit(state, acts, path, path_len)
        self.attn.commit(state, seqlen, path, path_len)
