"""Fusion on the device: a draft model's tree and a lookup tree merged by prefix inside the step graph, and the
composite drafter that offers the model's shapes, the lookup's, their fusions and plain decoding side by side.

``fuse_trees`` lays a ``fused:M+L`` tree out as M's nodes, then L's nodes below its root: a lookup node whose path
(root to node) is already in M's tree is left invalid and its lookup children hang from that M node instead, level
by level, so the merged tree has no duplicate siblings and each node's depth is fixed by the layout. Merging needs
point-mass children on both sides at sampled rows too, so the model part is a beam (deterministic at every
temperature); the host ``merge_trees`` (``fusion.py``) is the same prefix union, pruned on the host.

``CompositeDeviceDrafter`` keeps both drafters' slots in step: whichever tree a step verifies (the model's, the
lookup's or the fused one), both parts are told to ``follow`` it, so both commit along its accepted path. It catches
up as its model part does (plain steps leave both behind; one catch-up feeds both).
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.drafter_service.drafters.lookup.device_base import LookupDeviceDrafter
from stree.protocols.device_drafter import DeviceDraft, DeviceDrafter, DeviceDrafterBase
from stree.protocols.sampling import RowSampling
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_layout import LayoutCache
from stree.protocols.tree_shape import TreeShape

FUSED_MODEL_KINDS = ("beam",)
"""Model trees a fused shape may hold: point masses at every temperature, like the lookup's."""


def fuse_trees(model_tokens: torch.Tensor, model_parents: torch.Tensor, lookup_tokens: torch.Tensor,
               lookup_parents: torch.Tensor, lookup_valid: torch.Tensor, lookup_shape: TreeShape):
    """``(tokens, parents, valid)`` ``[B, Nm + Nl - 1]``: the prefix merge of ``[B, Nm]`` model trees (every node
    valid) and ``[B, Nl]`` lookup trees of the level-by-level ``lookup_shape`` (module docstring)."""
    b, nm = model_tokens.shape
    dev = model_tokens.device
    node = torch.arange(nm, device=dev)
    merged = [torch.zeros(b, 1, dtype=torch.long, device=dev)]  # each lookup node's place in the fused tree
    repeated = [torch.zeros(b, 1, dtype=torch.bool, device=dev)]
    starts, sizes = lookup_shape.level_starts(), lookup_shape.level_sizes
    for lo, size in zip(starts[1:], sizes[1:]):
        hi = lo + size
        placed = torch.cat(merged, 1)
        above = placed.gather(1, lookup_parents[:, lo:hi])  # [B, w]: the fused node of each one's parent
        token, ok = lookup_tokens[:, lo:hi], lookup_valid[:, lo:hi]
        same = ((model_parents[:, None, :] == above[:, :, None]) & (model_tokens[:, None, :] == token[:, :, None])
                & (node > 0))  # [B, w, Nm]: the model node with this node's path (a model parent's child)
        found = same.any(-1) & ok
        own = nm - 1 + torch.arange(lo, hi, device=dev)
        merged.append(torch.where(found, same.to(torch.uint8).argmax(-1), own.expand(b, -1)))
        repeated.append(found)
    placed, repeated = torch.cat(merged, 1), torch.cat(repeated, 1)
    parents = placed.gather(1, lookup_parents[:, 1:].clamp(min=0))
    tokens = torch.cat([model_tokens, lookup_tokens[:, 1:]], 1)
    valid = torch.cat([torch.ones_like(model_tokens, dtype=torch.bool), (lookup_valid & ~repeated)[:, 1:]], 1)
    return tokens, torch.cat([model_parents, parents], 1), valid


class CompositeDeviceDrafter(DeviceDrafterBase):
    """A draft model's device drafter (which ``follows_trees``) and a lookup drafter over the same slots, drafting
    ``shapes``: the model's (source ``""``), the lookup's (``lookup:...``) and fused ones
    (``fused:beam:..+lookup:..``)."""

    def __init__(self, model: DeviceDrafter, lookup: LookupDeviceDrafter, shapes: list):
        if not model.follows_trees:
            raise ValueError(f"{type(model).__name__} cannot follow another tree; it cannot be fused on the device")
        self.model, self.lookup = model, lookup
        self.catches_up = bool(model.catches_up)
        self.observes_target = bool(model.observes_target)
        self.shapes = list(shapes)
        for s in self.shapes:
            if s.kind != "none" and not self._can(s):
                raise ValueError(f"the composite drafter cannot lay out {s}")
        self.layouts: Optional[LayoutCache] = None

    def _can(self, shape: TreeShape) -> bool:
        if shape.kind == "fused":
            model, lookup = shape.parts
            return model.kind in FUSED_MODEL_KINDS and self.model.supports(model) and self.lookup.supports(lookup)
        return (self.lookup if shape.source == "lookup" else self.model).supports(shape)

    def supports(self, shape: TreeShape) -> bool:
        return shape in self.shapes

    def claim(self, owner: object) -> None:
        """Its parts' slots are the owner's too (a part shared with another engine would be taken over)."""
        self._owner = owner
        self.model.claim(owner)
        self.lookup.claim(owner)

    def claimed_by(self, owner: object) -> bool:
        return self._owner is owner and self.model.claimed_by(owner) and self.lookup.claimed_by(owner)

    def observe_target(self, hidden: torch.Tensor, slot: Optional[int] = None) -> None:
        self.model.observe_target(hidden, slot)

    # ----- slots -----------------------------------------------------------------------------------
    def new_slots(self, batch_size: int, max_seqlen: int, device=None) -> None:
        self.model.new_slots(batch_size, max_seqlen, device)
        self.lookup.new_slots(batch_size, max_seqlen, device)
        self.layouts = LayoutCache(batch_size, self.lookup.device)

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        self.model.prefill_slots(slots, contexts)
        self.lookup.prefill_slots(slots, contexts)

    def park(self, idle: torch.Tensor) -> None:
        self.model.park(idle)
        self.lookup.park(idle)

    def mutable(self) -> list[torch.Tensor]:
        return list(self.model.mutable()) + list(self.lookup.mutable())

    def warm_up_prefill(self) -> None:
        self.model.warm_up_prefill()

    # ----- in the step ------------------------------------------------------------------------------
    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        if not self.supports(shape):
            raise ValueError(f"the composite drafter offers {', '.join(map(str, self.shapes))}, not {shape}")
        depth = self.layouts.get(shape).depth
        if shape.kind == "fused":
            model_part, lookup_part = shape.parts
            own = self.model.draft(model_part, roots, sampling, any_sampled)
            looked = self.lookup.draft(lookup_part, roots, sampling, any_sampled)
            tokens, parents, valid = fuse_trees(own.tokens, own.parents, looked.tokens, looked.parents,
                                                looked.valid, lookup_part)
            self.model.follow(tokens, parents, depth)
            self.lookup.follow(tokens, parents, depth)
            return DeviceDraft(tokens, parents, None, DraftMode.DETERMINISTIC, valid)
        if shape.source == "lookup":
            draft = self.lookup.draft(shape, roots, sampling, any_sampled)
            self.model.follow(draft.tokens, draft.parents, depth)
            return draft
        draft = self.model.draft(shape, roots, sampling, any_sampled)
        self.lookup.follow(draft.tokens, draft.parents, depth)
        return draft

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        self.model.commit(path, path_len)
        self.lookup.commit(path, path_len)

    def step_roots(self, roots: torch.Tensor) -> None:
        self.model.step_roots(roots)
        self.lookup.step_roots(roots)

    def catch_up(self, backlog: torch.Tensor, count: torch.Tensor) -> None:
        self.model.catch_up(backlog, count)
        self.lookup.append(backlog, count)


FUSED_AUTO = (("beam:4x2", "lookup:chain:6"), ("beam:5x3", "lookup:trie:4x3"))
"""Fused shapes a composite under ``auto`` offers, where both parts are among its parts' shapes."""
FUSED_LOOKUP = TreeShape.parse("lookup:trie:4x3")
"""The lookup part fused with a given model beam when the lookup drafter offers several shapes."""


def composite_shapes(model_shapes: list, lookup_shapes: list) -> list:
    """The shapes a composite of a model drafter offering ``model_shapes`` and a lookup drafter offering
    ``lookup_shapes`` drafts: with a choice on the model's side (``auto``), plain decoding, every model and lookup
    shape and ``FUSED_AUTO``; with one model beam, that beam fused with the lookup's one shape (else
    ``FUSED_LOOKUP``); nothing for one model shape that is not a beam (fusing it is the host's job)."""
    model_trees = [s for s in model_shapes if s.kind != "none"]
    lookup_trees = [s for s in lookup_shapes if s.kind != "none"]
    if len(model_trees) > 1:
        fused = [TreeShape.fused(TreeShape.parse(m), TreeShape.parse(lk)) for m, lk in FUSED_AUTO
                 if TreeShape.parse(m) in model_trees and TreeShape.parse(lk) in lookup_trees]
        return [TreeShape.parse("none")] + model_trees + lookup_trees + fused
    if len(model_trees) != 1 or model_trees[0].kind not in FUSED_MODEL_KINDS:
        return []
    part = lookup_trees[0] if len(lookup_trees) == 1 else FUSED_LOOKUP
    return [TreeShape.fused(model_trees[0], part)] if part in lookup_trees else []
