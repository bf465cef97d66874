"""The tiny-vocabulary pair the sampled-output distribution tests share: a hybrid target and a Mamba2 draft, both
with sharpened logits (multiplied final norms), so their laws are far from uniform and differ from each other."""

from __future__ import annotations

import torch

from stree.verifier.model.checkpoint import init_model, load_model

VOCAB = 6


def sharpened_pair(root):
    """``(target, draft)`` written under ``root`` and loaded, then sharpened in memory."""
    small = dict(d_model=16, d_state=8, headdim=8, vocab_size=VOCAB)
    target = load_model(init_model(root / "t", arch="hybrid", n_layer=2, attn_layers=[1], seed=11, **small))
    draft = load_model(init_model(root / "d", arch="mamba2", n_layer=1, seed=12, **small))
    with torch.no_grad():
        target.backbone.norm_f.weight.mul_(12.0)
        draft.backbone.norm_f.weight.mul_(9.0)
    return target, draft
