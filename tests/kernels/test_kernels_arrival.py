"""Arrival counters: one eagerly zeroed buffer per device, grown only outside a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

from stree.kernels import arrival


def test_counters_are_one_zeroed_buffer_per_device_that_grows_eagerly():
    dev = torch.device("cpu")
    first = arrival.counters(dev, 8)
    assert first.dtype == torch.int32 and first.numel() >= arrival.RESERVED and not first.any()
    assert arrival.counters(dev, 100).data_ptr() == first.data_ptr()  # small asks share it
    grown = arrival.counters(dev, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any()
    assert arrival.counters(dev, 8).data_ptr() == grown.data_ptr()


def test_growing_inside_a_capture_is_refused_with_a_clear_error(monkeypatch):
    dev = torch.device("cpu")
    have = arrival.counters(dev, 8).numel()
    monkeypatch.setattr(arrival, "_capturing", lambda device: True)
    assert arrival.counters(dev, have).numel() == have  # what was reserved serves a capture
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        arrival.counters(dev, have + 1)
