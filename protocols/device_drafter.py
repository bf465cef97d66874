"""The device-drafter interface: a drafter whose whole draft for B sequence slots is device code.

The engine captures such a draft inside its one CUDA graph per step (draft, target tree pass,
verification, both commits). Host drafters (n-gram, retrieval, remote, plugins) keep the
``Drafter``/``DrafterSession`` interface; the engine pads their trees into a fixed node bucket.

Optional hooks the engine calls when a device drafter has them: ``observe_target(hidden, slot=None)``
hands it the target's final-norm hidden state at each slot's last accepted node (``[B, d]`` inside
the step, ``[d]`` for one slot after its prefill), for drafters that read the target's states
(TreeFlash); ``mutable()`` lists the tensors a step advances, when they are not a draft model's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from stree.protocols.sampling import RowSampling
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_shape import TreeShape


@dataclass
class DeviceDraft:
    """Trees for B slots in one fixed layout: ``tokens``/``parents`` ``[B, N]``; ``q`` ``[B, N, V]`` or None.

    ``q[b, i]`` is the draft distribution node i's children were drawn from (sampled rows of
    stochastic drafts); ``mode`` says how (see ``DraftMode``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: Optional[torch.Tensor]
    mode: DraftMode


@runtime_checkable
class DeviceDrafter(Protocol):
    """Draft state for B slots plus fixed-shape drafts over them (no host sync anywhere)."""

    def supports(self, shape: TreeShape) -> bool:
        """Whether ``draft`` can lay out trees of ``shape``."""
        ...

    def new_slots(self, batch_size: int, max_seqlen: int) -> None:
        """Allocate state for ``batch_size`` slots of up to ``max_seqlen`` tokens."""
        ...

    def prefill_slot(self, slot: int, context: torch.Tensor) -> None:
        """Load a joining sequence's context (every token before its root) into ``slot``."""
        ...

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        """``prefill_slot`` for many joining sequences at once (token id lists or tensors)."""
        ...

    def park(self, idle: torch.Tensor) -> None:
        """Rewind the slots marked in ``idle`` (``[B]`` bool): they hold no sequence."""
        ...

    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        """Trees rooted at ``roots`` (``[B]``), laid out as ``shape`` (a chain or static shape with its
        ``static_parents``: the verifier's kernels rely on it); sampled rows draw their children."""
        ...

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Advance every slot along its accepted path of the last draft (root first)."""
        ...

    def step_roots(self, roots: torch.Tensor) -> None:
        """Advance every slot by its root alone (a plain decoding step)."""
        ...


def prefill_each(drafter, slots: list[int], contexts: list) -> None:
    """``prefill_slots`` one slot at a time, for drafters whose per-slot prefill is cheap host work."""
    for slot, context in zip(slots, contexts):
        drafter.prefill_slot(slot, torch.as_tensor(context, dtype=torch.long))
