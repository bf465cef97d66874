"""TreeFlash drafts for B slots as device code: one block pass, then children per parent level by level.

The slot state is just the target's final-norm hidden state at each slot's last accepted node,
handed in by the engine (``observe_target``) inside the same step graph. A draft runs the block
pass once for all depths; each level's children are the top (greedy rows) or Gumbel-top (sampled
rows: draws without replacement from q) tokens of the conditional head given the parent token, or
of the depth's marginal when the conditional head is switched off (the ablation). q rows are the
warped distributions the children were drawn from, so sampling verification stays exact.
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.drafter_service.drafters.gumbel import pick_children
from stree.protocols.device_drafter import DeviceDraft, DeviceDrafterBase
from stree.protocols.sampling import RowSampling
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_shape import TreeShape
from stree.verifier.model.treeflash import TreeFlashNet


class TreeFlashDeviceDrafter(DeviceDrafterBase):
    """The engine's ``DeviceDrafter`` for a ``TreeFlashNet`` over chain/static layouts up to its depth; it observes
    the target's hidden state at the last accepted node, which is all it drafts from."""

    KINDS = ("chain", "static")
    observes_target = True

    def __init__(self, net: TreeFlashNet, conditional: bool = True):
        self.net = net
        self.conditional = conditional
        self.hidden: Optional[torch.Tensor] = None
        self._parents: dict = {}

    def supports(self, shape: TreeShape) -> bool:
        return shape.kind in self.KINDS and shape.max_depth <= self.net.config.depth

    # ----- slots: the target's hidden state at the last accepted node ------------------------
    def new_slots(self, batch_size: int, max_seqlen: int, device=None) -> None:
        self.hidden = torch.zeros(batch_size, self.net.config.d_target, device=self.net.device, dtype=self.net.dtype)
        self._parents = {}

    def mutable(self) -> list[torch.Tensor]:
        """What a step advances (the engine restores it after a graph capture's warm-up runs)."""
        return [self.hidden]

    def prefill_slot(self, slot: int, context: torch.Tensor) -> None:
        """Nothing to run: the engine hands the target's hidden state after ``context`` to ``observe_target``."""
        self.hidden[slot].zero_()

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        self.prefill_each(slots, contexts)

    def observe_target(self, hidden: torch.Tensor, slot: Optional[int] = None) -> None:
        """The target's final-norm hidden state at the last accepted node: ``[B, d]``, or ``[d]`` for one ``slot``."""
        if slot is None:
            self.hidden.copy_(hidden)
        else:
            self.hidden[slot].copy_(hidden)

    def park(self, idle: torch.Tensor) -> None:
        self.hidden.masked_fill_(idle[:, None], 0.0)

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Nothing to replay: the next ``observe_target`` carries the accepted context."""

    def step_roots(self, roots: torch.Tensor) -> None:
        """Nothing to feed: the plain step's ``observe_target`` carries the new context."""

    # ----- one draft ------------------------------------------------------------------------
    def _static_parents(self, shape: TreeShape, batch: int) -> torch.Tensor:
        if shape not in self._parents:
            parents = torch.tensor(shape.static_parents(), device=self.net.device)
            self._parents[shape] = parents.expand(batch, -1).contiguous()
        return self._parents[shape]

    def level_logits(self, states: torch.Tensor, depth: int, parent_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, F, V]`` child logits of the F nodes at ``depth`` (tokens ``parent_tokens`` ``[B, F]``)."""
        row = states[:, depth: depth + 1].expand(-1, parent_tokens.shape[1], -1)
        if self.conditional:
            return self.net.conditional_logits(row, parent_tokens)
        return self.net.marginal_logits(row)

    @torch.no_grad()
    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        """A ``shape`` tree rooted at ``roots`` ([B]) from one block pass; q rows for sampled rows."""
        if not self.supports(shape):
            raise ValueError(f"treeflash drafts chain/static trees up to depth {self.net.config.depth}, not {shape}")
        b, n, vocab = roots.shape[0], shape.num_nodes, self.net.vocab_size
        starts, sizes = shape.level_starts(), shape.level_sizes
        states = self.net.depth_states(self.hidden, roots)  # the single pass: [B, K, d]
        tokens = torch.zeros(b, n, dtype=torch.long, device=roots.device)
        tokens[:, 0] = roots
        # greedy drafts need neither the warped draft law (a sort over the vocabulary per level) nor its q rows
        q = torch.zeros(b, n, vocab, device=roots.device) if any_sampled else None
        sampled = (sampling.temperature > 0)[:, None, None]
        for d, w in enumerate(shape.widths):
            lo, hi = starts[d], starts[d] + sizes[d]
            rows = self.level_logits(states, d, tokens[:, lo:hi])
            probs = None
            if any_sampled:
                probs = sampling.warp(rows)
                q[:, lo:hi] = probs
            picks = pick_children(rows, probs, w, sampled, any_sampled, sampling, d)
            tokens[:, starts[d + 1]: starts[d + 1] + sizes[d + 1]] = picks.reshape(b, -1)
        return DeviceDraft(tokens, self._static_parents(shape, b), q, DraftMode.WITHOUT_REPLACEMENT)
