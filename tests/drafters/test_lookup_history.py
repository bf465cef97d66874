"""A plain step's root append (``SlotHistory.append_roots``, the few-kernel path every plain step's graph runs while
goodput control decodes plainly under a lookup drafter) leaves exactly what the general ``append`` of one token
leaves: random histories, empty and full slots among them."""

from __future__ import annotations

import pytest
import torch

from stree.drafter_service.drafters.lookup.history import SlotHistory


@pytest.mark.parametrize("seed", range(6))
def test_append_roots_equals_a_one_token_append(seed):
    g = torch.Generator().manual_seed(seed)
    batch, capacity, pad = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)), 3
    general, fast = SlotHistory(batch, capacity, pad, "cpu"), SlotHistory(batch, capacity, pad, "cpu")
    for slot in range(batch):
        n = int(torch.randint(0, capacity + 1, (1,), generator=g))  # empty and full slots included
        context = torch.randint(0, 50, (n,), generator=g)
        general.load(slot, context)
        fast.load(slot, context)
    for _ in range(capacity + 2):  # past every slot's capacity
        roots = torch.randint(0, 50, (batch,), generator=g)
        general.append(roots[:, None], torch.ones_like(roots))
        fast.append_roots(roots)
        assert torch.equal(fast.tokens, general.tokens) and torch.equal(fast.length, general.length)
    assert int(fast.length.max()) == capacity
