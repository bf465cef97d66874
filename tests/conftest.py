"""Shared fixtures: tiny random checkpoints written to disk once per test session; seeded randomness.

Every test starts from torch/numpy/random seeded with ``STREE_TEST_SEED`` (random unless set) plus
a hash of the test's id; the seed is printed in the header and beside any failure, so
``STREE_TEST_SEED=<seed> pytest <test>`` replays it. Hypothesis prints its own reproduction blob.
"""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings

BASE_SEED = int(os.environ.get("STREE_TEST_SEED", random.SystemRandom().randrange(2**31)))
settings.register_profile("stree", print_blob=True, deadline=None)
settings.load_profile("stree")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU interpreter in CI

from stree.verifier.model.checkpoint import init_model, load_model

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


def pytest_report_header(config):
    return f"stree test seed: STREE_TEST_SEED={BASE_SEED}"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Seed every RNG from the base seed and the test id (fresh inputs per run, replayable)."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.when == "call":
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            item.add_report_section("call", "seed", f"replay with STREE_TEST_SEED={BASE_SEED} (test seed {seeds[0]})")
