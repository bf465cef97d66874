"""The shape of a model trained from scratch (Mamba2 layers, attention layers for a hybrid), and its random init."""

from __future__ import annotations

from dataclasses import dataclass

from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM


@dataclass
class Shape:
    """Model size: Mamba2 layers, with attention at ``attn_layers`` (a hybrid) when non-empty."""

    d_model: int
    n_layer: int
    attn_layers: tuple = ()
    d_state: int = 64
    headdim: int = 64
    attn_head_dim: int = 64

    def config(self, vocab_size: int) -> ModelConfig:
        attn = {}
        if self.attn_layers:
            heads = max(1, self.d_model // self.attn_head_dim)
            attn = {"num_heads": heads, "num_heads_kv": heads, "head_dim": self.d_model // heads,
                    "rotary_emb_dim": self.d_model // heads}
        return ModelConfig(
            d_model=self.d_model, n_layer=self.n_layer, vocab_size=vocab_size,
            ssm_cfg={"layer": "Mamba2", "d_state": self.d_state, "headdim": self.headdim, "expand": 2},
            attn_layer_idx=list(self.attn_layers), attn_cfg=attn,
        )


def make_model(shape: Shape, vocab_size: int, seed: int, device, rescale_residual: bool = False) -> StreeLM:
    return random_init_(StreeLM(shape.config(vocab_size)), seed, rescale_residual).to(device)
