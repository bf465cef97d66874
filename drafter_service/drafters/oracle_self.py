"""The device oracle's continuation in any dtype: the target drafts for itself on the oracle's tree shape.

In bf16 a tree pass and a one-token step round differently, so plain greedy decoding's output is not
what a speculative run produces, and an oracle holding it loses τ after the first near-tie.
``SelfOracleDrafter`` is the target as its own device draft model on one chain
or static shape (greedy), with every node below depth ``k`` made certainly wrong: each step accepts
exactly ``k`` tokens plus the bonus. Its output is the continuation for an ``OracleDeviceDrafter``
with the same ``k``, shape and batch: that run's target tree passes see the same tokens on every
node they accept (a node's output depends only on its ancestors), so they compute the same values
and accept exactly ``k`` per step again, in any dtype. Greedy decoding only; for benchmarks.
"""

from __future__ import annotations

import torch

from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.drafter_service.drafters.oracle_device import wrong_salts
from stree.protocols.device_drafter import DeviceDraft, DeviceOffer
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape


class SelfOracleDrafter(DeviceTreeDrafter):
    """The target drafting ``shape`` for itself, right on the first node of levels 1..k and wrong below."""

    name = "self-oracle"

    def __init__(self, target, shape: TreeShape | str, correct_depth: int):
        super().__init__(target)
        self.tree = shape if isinstance(shape, TreeShape) else TreeShape.parse(shape)
        if self.tree.kind not in ("chain", "static"):
            raise ValueError(f"self oracle: {self.tree} must be a chain or static tree")
        if not 0 <= correct_depth < self.tree.max_depth:
            raise ValueError(f"self oracle: correct_depth {correct_depth} must be below the tree's depth "
                             f"({self.tree.max_depth}): a wrong level must follow the right ones")
        self.k = int(correct_depth)
        depth = torch.tensor(self.tree.depths(), device=target.device)
        self._deep = depth > self.k  # [N] the nodes made wrong
        parents = self.tree.static_parents()
        # [N] each node's first sibling: its parent's greedy child (the root stands for itself)
        self._first = torch.tensor([parents.index(p) if p >= 0 else 0 for p in parents], device=target.device)
        self._salt = wrong_salts(self.tree.num_nodes, target.vocab_size, target.device)

    def device_drafter(self) -> DeviceOffer:
        return DeviceOffer(self, [self.tree])

    def open(self, prompt_ids, params):
        raise ValueError("self oracle: drafts on the device only (greedy, one chain or static shape)")

    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        if any_sampled:
            raise ValueError("self oracle: greedy decoding only")
        d = super().draft(shape, roots, sampling, any_sampled)
        # a node's first sibling holds the greedy choice at their parent, so a salt added to it makes every
        # deep node differ from what its own parent accepts, on whichever branch was accepted
        wrong = (d.tokens[:, self._first] + self._salt) % self.model.vocab_size
        return DeviceDraft(torch.where(self._deep[None, :], wrong, d.tokens), d.parents, None, d.mode)
