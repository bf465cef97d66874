"""What the device n-gram and retrieval drafters share: slot histories, their bookkeeping, and the tree rule.

A subclass finds each slot's candidate continuations (``candidates_of``: rows of up to ``horizon`` tokens, their lengths
and priorities, as device tensors); this base makes them a chain or a trie by the shared rule (``device_tree.py``)
and keeps the histories in step: ``prefill_slots`` loads contexts between steps, a drafted step's ``commit`` appends
the accepted path's tokens (from its own draft, or from the tree it was told to ``follow``), a plain step appends
its root, ``park`` empties idle slots. Drafts are point masses (deterministic): lossless at every temperature.
"""

from __future__ import annotations

import abc
from typing import Optional

import torch

from stree.drafter_service.drafters.lookup.device_tree import lookup_trees
from stree.drafter_service.drafters.lookup.history import SlotHistory
from stree.protocols.device_drafter import DeviceDraft, DeviceDrafterBase
from stree.protocols.sampling import RowSampling
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_shape import LOOKUP_KINDS, TreeShape


class LookupDeviceDrafter(DeviceDrafterBase, abc.ABC):
    """Model-free drafts of ``shapes`` (lookup chains and tries) over each slot's history.

    ``candidates`` (rows looked at per draft) must be at least every shape's branch count. Chains rank their rows
    over ``chain_horizon`` tokens (the deepest chain offered) whatever their own length, so a chain's token at depth d
    is the same for every chain length (goodput control pools chains by depth); tries rank over their own depth.
    """

    follows_trees = True
    history_pad = 1  # leading NO_TOKEN columns the subclass's lookups need before a slot's first token

    def __init__(self, shapes: list, candidates: int, device=None):
        self.shapes = [s for s in shapes if s.kind != "none"]
        for s in self.shapes:
            if s.source != "lookup" or s.kind not in LOOKUP_KINDS:
                raise ValueError(f"a lookup drafter lays out lookup:chain:K and lookup:trie:DxW trees, not {s}")
        self.candidates = int(candidates)
        widest = max((s.max_width for s in self.shapes), default=1)
        if self.candidates < widest:
            raise ValueError(f"lookup drafter: {widest} branches need at least as many candidates, got {candidates}")
        self.chain_horizon = max((s.max_depth for s in self.shapes if s.kind == "chain"), default=1)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.history: Optional[SlotHistory] = None
        self._tree_tokens: Optional[torch.Tensor] = None  # [B, N]: the tree the next commit's path indexes

    # ----- slots -----------------------------------------------------------------------------------
    def supports(self, shape: TreeShape) -> bool:
        return shape in self.shapes

    def new_slots(self, batch_size: int, max_seqlen: int, device=None) -> None:
        if device is not None:
            self.device = torch.device(device)
        if max_seqlen < self.candidates:
            raise ValueError(f"lookup drafter: {max_seqlen} tokens per slot is fewer than its {self.candidates} "
                             "candidates")
        self.on_device(self.device)
        self.history = SlotHistory(batch_size, max_seqlen, self.history_pad, self.device)
        self._tree_tokens = None

    def on_device(self, device: torch.device) -> None:
        """Move what the subclass keeps (a datastore) to ``device`` before slots are made there."""

    def mutable(self) -> list[torch.Tensor]:
        return self.history.mutable()

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        for slot, context in zip(slots, contexts):
            self.history.load(slot, torch.as_tensor(context, dtype=torch.long))

    def park(self, idle: torch.Tensor) -> None:
        self.history.rewind(idle)

    # ----- in the step ------------------------------------------------------------------------------
    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        if not self.supports(shape):
            raise ValueError(f"this lookup drafter offers {', '.join(map(str, self.shapes))}, not {shape}")
        self.history.put_roots(roots)
        branches, depth = shape.max_width, shape.max_depth
        horizon = self.chain_horizon if shape.kind == "chain" else depth
        rows, lengths, priority = self.candidates_of(horizon)
        tokens, parents, valid = lookup_trees(roots, rows, lengths, priority, branches, depth)
        self._tree_tokens = tokens
        return DeviceDraft(tokens, parents, None, DraftMode.DETERMINISTIC, valid)

    @abc.abstractmethod
    def candidates_of(self, horizon: int):
        """``(rows [B, K, horizon], lengths [B, K], priority [B, K])``: each slot's candidate continuations, with
        its root written at its history's length (``ngram_device.py``, ``retrieval_device.py``)."""

    def follow(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> None:
        self._tree_tokens = tokens

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Append the root and the accepted nodes' tokens of the tree this step verified."""
        self.history.append(self._tree_tokens.gather(1, path), path_len)

    def step_roots(self, roots: torch.Tensor) -> None:
        self.history.append(roots[:, None])

    def append(self, tokens: torch.Tensor, count: torch.Tensor) -> None:
        """Append each slot's first ``count[b]`` of ``tokens`` (a composite drafter's catch-up)."""
        self.history.append(tokens, count)
