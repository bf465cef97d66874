"""The device-drafter contract: a drafter whose whole draft for B sequence slots is device code.

The engine captures such a draft inside its one CUDA graph per step (draft, target tree pass, verification,
both commits). Host drafters (n-gram, retrieval, remote, plugins) keep the ``Drafter``/``DrafterSession``
interface instead; the engine pads their trees into a fixed node bucket.

What the engine calls, and when:

- always: ``supports``, ``new_slots`` (once per engine, with the engine's device), ``prefill_slots`` (a sequence
  joins, or its stale slot is refreshed), ``park`` (after every step: rewind slots that hold no sequence), ``draft`` then ``commit`` (a
  drafted step), ``step_roots`` (a plain step, unless the drafter ``catches_up``), ``mutable`` (the tensors a step
  advances: the engine saves and restores them around a graph capture's warm-up runs), ``warm_up_prefill``
  (compile and capture its prefill ahead of traffic);
- only when ``observes_target`` is True: ``observe_target(hidden, slot=None)`` with the target's final-norm hidden
  state at each slot's last accepted node (``[B, d]`` inside the step, ``[d]`` for one slot after its prefill);
- only when ``catches_up`` is True: the engine may skip ``step_roots`` on plain steps and instead call
  ``catch_up(backlog, count)`` once before the next draft with every token it skipped (``backlog`` ``[B, L]``,
  ``count`` ``[B]``); past ``L`` tokens it lets the slot go stale and refreshes it with ``prefill_slots`` from the
  whole sequence instead.

A drafter that ``follows_trees`` can also be told, after its own draft (or instead of one), that the step verifies
another tree: ``follow(tokens, parents, depth)`` makes its next ``commit`` advance along that tree's path. A composite
drafter (a draft model beside prompt lookup, ``fused`` shapes) verifies trees its parts did not draft alone.

``DeviceDrafterBase`` gives the optional parts their defaults (every flag False, no prefill warm-up), so a drafter
states what it does by what it overrides. A drafter's slots belong to the last engine that called ``new_slots``;
``claim``/``claimed_by`` let an earlier engine notice it no longer owns them.
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
    stochastic drafts); ``mode`` says how (see ``DraftMode``). ``valid`` ``[B, N]`` (None: every node) marks the
    nodes that are drafted; an invalid node is never accepted, and no valid node descends from it (a lookup with
    fewer continuations than its layout holds, a fused node already in the other part's tree).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: Optional[torch.Tensor]
    mode: DraftMode
    valid: Optional[torch.Tensor] = None


@runtime_checkable
class DeviceDrafter(Protocol):
    """Draft state for B slots plus fixed-shape drafts over them (no host sync anywhere)."""

    observes_target: bool
    catches_up: bool
    follows_trees: bool

    def supports(self, shape: TreeShape) -> bool:
        """Whether ``draft`` can lay out trees of ``shape``."""
        ...

    def new_slots(self, batch_size: int, max_seqlen: int, device: Optional[torch.device] = None) -> None:
        """Allocate state for ``batch_size`` slots of up to ``max_seqlen`` tokens on ``device`` (the engine's; a
        drafter bound to a model keeps its model's, None: the drafter's own)."""
        ...

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        """Load each joining sequence's context (every token before its root; id lists or tensors) into its slot."""
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

    def mutable(self) -> list[torch.Tensor]:
        """The tensors a step advances."""
        ...

    def warm_up_prefill(self) -> None:
        """Compile and capture whatever ``prefill_slots`` runs, while no slot holds a sequence."""
        ...

    def observe_target(self, hidden: torch.Tensor, slot: Optional[int] = None) -> None:
        """The target's hidden state at the last accepted node (called only when ``observes_target``)."""
        ...

    def catch_up(self, backlog: torch.Tensor, count: torch.Tensor) -> None:
        """Feed each slot's first ``count[b]`` tokens of ``backlog`` (called only when ``catches_up``)."""
        ...

    def follow(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> None:
        """The step verifies these trees (``[B, N]``): the next ``commit``'s path indexes them (called only when
        ``follows_trees``)."""
        ...

    def claim(self, owner: object) -> None:
        """Record ``owner`` (an engine) as the holder of the slots it is about to allocate."""
        ...

    def claimed_by(self, owner: object) -> bool:
        """Whether ``owner`` still holds the slots."""
        ...


class DeviceDrafterBase:
    """Defaults for a ``DeviceDrafter``'s optional parts; subclasses implement the rest."""

    observes_target = False
    catches_up = False
    follows_trees = False
    _owner: Optional[object] = None

    def mutable(self) -> list[torch.Tensor]:
        return []

    def warm_up_prefill(self) -> None:
        """Nothing to compile ahead."""

    def observe_target(self, hidden: torch.Tensor, slot: Optional[int] = None) -> None:
        raise RuntimeError(f"{type(self).__name__} does not observe the target (observes_target is False)")

    def catch_up(self, backlog: torch.Tensor, count: torch.Tensor) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot catch up (catches_up is False)")

    def follow(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> None:
        raise RuntimeError(f"{type(self).__name__} cannot follow another tree (follows_trees is False)")

    def claim(self, owner: object) -> None:
        self._owner = owner

    def claimed_by(self, owner: object) -> bool:
        return self._owner is owner

    def prefill_each(self, slots: list[int], contexts: list) -> None:
        """``prefill_slots`` one slot at a time through ``prefill_slot``, for drafters whose per-slot prefill is
        cheap host work."""
        for slot, context in zip(slots, contexts):
            self.prefill_slot(slot, torch.as_tensor(context, dtype=torch.long))


@dataclass
class DeviceOffer:
    """What ``Drafter.device_drafter`` returns: the device drafter and the tree shapes it offers (``none`` among
    them lets the engine choose plain steps too)."""

    drafter: DeviceDrafter
    shapes: list
