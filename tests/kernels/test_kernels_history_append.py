"""Appending to the lookup drafters' slot histories (``history_append``): the reference equals a plain-Python model
of each slot's list (empty and full slots, counts of 0, past the tokens given and past the capacity), and the Triton
kernel (interpreter) leaves the reference's buffer and lengths bit for bit, for general appends and a plain step's
one root per slot."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from stree.kernels.history_append import history_append_ref  # noqa: E402
from stree.kernels.history_append_triton import history_append_triton  # noqa: E402

PAD = 3


def _histories(g, batch: int, capacity: int):
    """A ``[B, PAD + capacity]`` buffer (-1 pad, random tokens past each length) and lengths from 0 to capacity."""
    buf = torch.randint(0, 50, (batch, PAD + capacity), generator=g)
    buf[:, :PAD] = -1
    length = torch.randint(0, capacity + 1, (batch,), generator=g)
    length[0] = capacity  # a full slot
    return buf, length


@pytest.mark.parametrize("seed", range(8))
def test_reference_appends_as_a_list_per_slot(seed):
    g = torch.Generator().manual_seed(seed)
    batch, capacity, width = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)), \
        int(torch.randint(1, 6, (1,), generator=g))
    buf, length = _histories(g, batch, capacity)
    new = torch.randint(0, 50, (batch, width), generator=g)
    count = torch.randint(0, width + 3, (batch,), generator=g)  # past the tokens given, too
    want = [buf[b, PAD: PAD + int(length[b])].tolist() + new[b, : int(count[b])].tolist() for b in range(batch)]
    history_append_ref(buf, length, new, count, PAD)
    for b in range(batch):
        kept = want[b][:capacity]
        assert buf[b, PAD: PAD + len(kept)].tolist() == kept
        assert int(length[b]) == min(len(want[b]) + max(0, int(count[b]) - width), capacity)
    assert bool((buf[:, :PAD] == -1).all())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("roots", [False, True])
def test_triton_kernel_leaves_the_reference_bits(seed, roots):
    g = torch.Generator().manual_seed(100 + seed)
    batch, capacity = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    buf, length = _histories(g, batch, capacity)
    ref_buf, ref_len = buf.clone(), length.clone()
    for _ in range(capacity + 2):  # past every slot's capacity
        if roots:  # a plain step: one root per slot, a column view of a wider tensor
            new, count = torch.randint(0, 50, (batch, 2), generator=g)[:, :1], None
        else:
            width = int(torch.randint(1, 6, (1,), generator=g))
            new, count = torch.randint(0, 50, (batch, width), generator=g), torch.randint(0, width + 1, (batch,),
                                                                                           generator=g)
        history_append_ref(ref_buf, ref_len, new, count, PAD)
        history_append_triton(buf, length, new, count, PAD)
        assert torch.equal(buf, ref_buf) and torch.equal(length, ref_len)
    assert int(length.max()) == capacity
