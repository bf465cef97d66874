"""``history_append`` in one Triton launch, one program per slot (reference: ``history_append.history_append_ref``).

A plain step's root and a commit's accepted path reach each slot's history in one kernel instead of the reference's
ten small PyTorch launches, which every plain step of a lookup drafter pays while goodput control decodes plainly.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter


@triton.jit
def _history_append_kernel(buf_ptr, len_ptr, new_ptr, count_ptr, L, capacity, pad, s_bb, s_bc, s_nb, s_nl,
                           HAS_COUNT: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0)
    n = tl.load(len_ptr + b)
    if HAS_COUNT:
        c = tl.load(count_ptr + b).to(tl.int64)
    else:
        c = n * 0 + L
    j = tl.arange(0, BL)
    at = n + j
    keep = (j < L) & (j < c) & (at < capacity)
    vals = tl.load(new_ptr + b * s_nb + j * s_nl, mask=j < L, other=0)
    tl.store(buf_ptr + b * s_bb + (at + pad) * s_bc, vals, mask=keep)
    tl.store(len_ptr + b, tl.minimum(n + tl.maximum(c, 0), capacity))


def history_append_triton(buf: torch.Tensor, length: torch.Tensor, new: torch.Tensor, count: Optional[torch.Tensor],
                          pad: int) -> None:
    """As ``history_append_ref``, in place."""
    batch, width = new.shape
    if batch == 0:
        return
    count_arg = count if count is not None else length  # unread without HAS_COUNT
    _history_append_kernel[(batch,)](
        buf, length, new, count_arg, width, buf.shape[1] - pad, pad, buf.stride(0), buf.stride(1), new.stride(0),
        new.stride(1), HAS_COUNT=count is not None, BL=max(triton.next_power_of_2(width), 2),
        **pdl.launch_args(buf.device))
