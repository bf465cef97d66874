"""Targets whose greedy output loops, so lookup drafts really get accepted: tiny random models whose greedy choice
follows a planted successor of each token (``stree.bench.oracle.plant_successors_``) until it falls into a cycle."""

from __future__ import annotations

import torch

from stree.bench.oracle import plant_successors_
from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM


def looping_target(attn: bool, seed: int, vocab: int = 64, d_model: int = 32, device="cpu") -> StreeLM:
    """A 2-layer Mamba2 (``attn``: Mamba2 + attention) target of ``vocab`` tokens whose output soon cycles."""
    cfg = ModelConfig(d_model=d_model, n_layer=2, vocab_size=vocab, tie_embeddings=False,
                      attn_layer_idx=[1] if attn else [], attn_cfg={"num_heads": 2} if attn else {},
                      ssm_cfg={"layer": "Mamba2", "d_state": 8, "headdim": 8})
    model = random_init_(StreeLM(cfg), seed, rescale_residual=True)
    with torch.no_grad():
        plant_successors_(model, seed)
    return model.to(device).eval()
