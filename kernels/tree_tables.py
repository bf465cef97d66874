"""The tree kernels' per-pass tables: each node's conv taps and the ancestor-or-self mask of a padded tree batch.

Both depend only on ``parents``, which every layer of a tree pass shares, so one pass builds them once (device
ops, no host sync: CUDA-graph safe) and each layer's kernel loads them instead of walking ``parents`` (a chain
of dependent global loads per conv tap, and log2(N) boolean squarings for the mask). They reproduce the
kernels' own walk and mask exactly, including their sanitising of malformed parents.
"""

from __future__ import annotations

import torch

from stree.protocols.token_tree import ancestor_mask

ANC_MAX_NODES = 64
"""Largest padded tree whose ancestor mask is tabled: the whole-tree tile of the small tree kernels
(``tree_scan_triton.SMALL_MAX_NODES``); larger trees' kernels walk ``parents`` for their mask."""


def conv_taps(parents: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, N, K]`` int32: what tap k of node n's tree conv reads, as ``tree_conv_tile``'s walk finds it.

    ``>= 0`` a tree node (``k = 0`` the node itself), ``-m`` the m-th most recent committed input (conv-state
    column ``K-1-m``). One step up from node ``c > 0`` goes to ``min(max(parents[c], -1), c - 1)``, from
    ``c <= 0`` to ``c - 1``, parents read as int32 as the kernel reads them.
    """
    b, n = parents.shape
    dev = parents.device
    # step[:, c + K] = K + (one step up from c), for c in [-K, N): each tap is one gather, in few launches
    above = torch.arange(-1, width - 1, device=dev).expand(b, width)
    up = torch.minimum(parents.to(torch.int32).clamp(min=-1), torch.arange(-1, n - 1, device=dev)) + width
    step = torch.cat([above, up], dim=1)
    cur = torch.arange(width, n + width, device=dev).expand(b, n)
    taps = [cur]
    for _ in range(width - 1):
        cur = step.gather(1, cur)
        taps.append(cur)
    return (torch.stack(taps, dim=2) - width).to(torch.int32)


def kernel_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool ancestor-or-self mask as ``small_tree_mask`` builds it: a parent that is negative or
    not earlier than its node makes the node a root. On well-formed trees it is ``ancestor_mask``."""
    nodes = torch.arange(parents.shape[1], device=parents.device)
    # the int32 the kernel reads, as unsigned: negative parents become large, so one minimum points roots home
    return ancestor_mask(torch.minimum(parents.long() & 0xFFFFFFFF, nodes))


class TreeTables:
    """The tables of one tree pass over ``parents`` ``[B, N]``, each built on first use and then shared by every
    layer: ``taps(width)`` (one per conv width of the model) and ``anc`` (``None`` over ``ANC_MAX_NODES``)."""

    def __init__(self, parents: torch.Tensor):
        self.parents = parents
        self._taps: dict[int, torch.Tensor] = {}
        self._anc: torch.Tensor | None = None

    def taps(self, width: int) -> torch.Tensor:
        """``conv_taps(parents, width)``, built once per width."""
        if width not in self._taps:
            self._taps[width] = conv_taps(self.parents, width)
        return self._taps[width]

    @property
    def anc(self) -> torch.Tensor | None:
        """``kernel_ancestor_mask(parents)``, built once; ``None`` for trees over ``ANC_MAX_NODES`` nodes."""
        if self._anc is None and self.parents.shape[1] <= ANC_MAX_NODES:
            self._anc = kernel_ancestor_mask(self.parents)
        return self._anc


def check_table(table: torch.Tensor | None, shape: tuple, what: str) -> None:
    """Shape check of an optional table given to a kernel wrapper (no device sync); ``what`` names it."""
    if table is not None and tuple(table.shape) != shape:
        raise ValueError(f"{what} {tuple(table.shape)} must be {list(shape)}")


def table_args(table: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """``(pointer, strides)`` kernel arguments of an optional 3-d table: itself, or ``dummy`` with zero strides
    (its kernel flag is off, so nothing is read)."""
    return (table, table.stride()) if table is not None else (dummy, (0, 0, 0))
