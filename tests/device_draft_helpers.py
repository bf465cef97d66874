"""Helpers shared by the device-draft tests: a drafter with prefilled slots, and states compared field by field."""

from __future__ import annotations

import torch

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter


def prefilled_drafter(model, contexts, **options) -> DeviceTreeDrafter:
    """A ``DeviceTreeDrafter(model, **options)`` with one slot per context, each prefilled with it."""
    d = DeviceTreeDrafter(model, **options)
    d.new_slots(len(contexts), 64)
    d.prefill_slots(list(range(len(contexts))), contexts)
    return d


def states_close(a, b) -> None:
    """Every per-layer field of two model states (or two drafts' commit activations) agrees (fp32 tolerance), and
    so do the states' lengths."""
    if hasattr(a, "seqlen"):
        assert torch.equal(a.seqlen, b.seqlen)
    for la, lb in zip(a.layers, b.layers):
        for name in vars(la):
            torch.testing.assert_close(getattr(la, name), getattr(lb, name), atol=1e-5, rtol=1e-5)
