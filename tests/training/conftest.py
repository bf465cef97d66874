"""The training tests run their tiny models on one CPU thread (and so do the processes they start): at this size
more threads only add synchronisation, which on a busy two-core machine costs several times the work."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(before)
