"""The GPU tests' tiny checkpoints: a pure Mamba2 and a hybrid target and a smaller Mamba2 draft."""

from __future__ import annotations

import pytest

from stree.verifier.model.checkpoint import init_model


@pytest.fixture(scope="session")
def gpu_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    shape = dict(d_model=256, n_layer=4, d_state=64, headdim=64, vocab_size=1000)
    dirs = {
        "mamba2": init_model(root / "m", arch="mamba2", seed=1, **shape),
        "hybrid": init_model(root / "h", arch="hybrid", attn_layers=[2], seed=2, **shape),
        "draft": init_model(root / "d", arch="mamba2", seed=3, d_model=128, n_layer=2, d_state=32, headdim=32,
                            vocab_size=1000),
    }
    return dirs
