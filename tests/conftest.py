"""Shared fixtures: tiny random checkpoints written to disk once per test session."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter in CI

from stree.verifier.checkpoint import init_model, load_model

TINY = dict(d_model=32, n_layer=3, d_state=8, headdim=8, vocab_size=64)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Checkpoint dirs: pure Mamba2 target, hybrid target, small Mamba2 draft, tiny-vocab pair."""
    root = tmp_path_factory.mktemp("models")
    dirs = {
        "mamba2": init_model(root / "mamba2", arch="mamba2", seed=1, **TINY),
        "hybrid": init_model(root / "hybrid", arch="hybrid", seed=2, attn_layers=[1], **TINY),
        "draft": init_model(root / "draft", arch="mamba2", seed=3, d_model=32, n_layer=1, d_state=8,
                            headdim=8, vocab_size=64),
    }
    return dirs


@pytest.fixture(scope="session")
def models(model_dirs):
    torch.manual_seed(0)
    return {name: load_model(path) for name, path in model_dirs.items()}
