"""A tree shape's fixed layout for B slots as device constants, built once per (shape, batch, device).

Every step of a fixed shape (chain, static, beam, trie, fused) reads the same depths and node counts, and chains and
static trees the same parents and ancestor mask: the engine and the device drafters take them from one
``LayoutCache`` instead of rebuilding them (a dozen small launches) every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stree.protocols.token_tree import ancestor_mask
from stree.protocols.tree_shape import TreeShape


@dataclass(frozen=True)
class TreeLayout:
    """``depth`` ``[B, N]``, ``count`` ``[B]`` (N), ``valid`` ``[B, N]`` (all True); for shapes whose parents never
    change (none, chain, static): ``parents`` ``[B, N]`` and, when asked for, the ancestor mask ``anc`` ``[B, N, N]``."""

    shape: TreeShape
    depth: torch.Tensor
    count: torch.Tensor
    valid: torch.Tensor
    parents: Optional[torch.Tensor]
    anc: Optional[torch.Tensor]


def fixed_parents(shape: TreeShape) -> bool:
    """Whether ``shape``'s parents are the same every step (beams choose theirs as they draft)."""
    return shape.kind in ("none", "chain", "static")


class LayoutCache:
    """``TreeLayout`` of each shape for ``batch`` slots on ``device``, made on first use and kept."""

    def __init__(self, batch: int, device):
        self.batch = int(batch)
        self.device = torch.device(device)
        self._layouts: dict = {}

    def get(self, shape: TreeShape, with_ancestors: bool = False) -> TreeLayout:
        shape = shape.layout  # whoever fills it (its source), a layout's constants are the same
        key = (shape, with_ancestors)
        if key not in self._layouts:
            b, n, dev = self.batch, shape.num_nodes, self.device
            depth = torch.tensor(shape.depths(), device=dev).expand(b, n).contiguous()
            count = torch.full((b,), n, dtype=torch.long, device=dev)
            valid = torch.ones(b, n, dtype=torch.bool, device=dev)
            parents = anc = None
            if fixed_parents(shape):
                parents = torch.tensor(shape.static_parents(), device=dev).expand(b, n).contiguous()
                anc = ancestor_mask(parents) if with_ancestors else None
            self._layouts[key] = TreeLayout(shape, depth, count, valid, parents, anc)
        return self._layouts[key]

    def chain(self, nodes: int, with_ancestors: bool = False) -> TreeLayout:
        """The layout of a chain of ``nodes`` nodes (a drafter's catch-up feeds its backlog as one)."""
        return self.get(TreeShape("chain", widths=(1,) * (nodes - 1)), with_ancestors)
