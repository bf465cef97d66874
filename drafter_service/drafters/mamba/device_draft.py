"""Chain, static and beam drafts of a draft model for B sequences at once, as device code (no host sync).

The draft model grows the tree with tree passes over the template's fixed node layout: pass d
scores the nodes of depth d-1 (deeper nodes are placeholders; in a tree pass a node only sees its
ancestors, so placeholders never change a real node) and picks their children. A last pass over the
finished tree leaves the activations that move the draft state along the accepted path by replay,
exactly as the target's commit does, so the draft state never steps token by token and never
reorders rows. Everything has fixed shapes, so the engine captures it inside its one step graph.
That last pass runs when the commit needs it, over the tree the step verified: the draft's own, or
another one the drafter was told to ``follow`` (a lookup tree, or its own merged with one).

On a pure Mamba2 draft model, chains and beams are picked by one-token decode steps instead
(``chain_steps``, ``beam_steps``): a chain steps a scratch copy of the slots' state (an SSM state
is small); a beam's M rows step from their parents' rows into a second scratch state, depth by depth in turn
(the root's step from the slots' rows, one row per sequence), so beams stay in place by index and no state is
gathered. That costs fewer launches than a tree pass per depth and runs the LM head over M rows, not the whole
tree; one tree pass over the finished tree still leaves the commit's activations, so the commit is the same replay.
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.drafter_service.drafters.gumbel import pick_children
from stree.protocols.device_drafter import DeviceDraft, DeviceDrafterBase
from stree.protocols.sampling import RowSampling
from stree.protocols.token_tree import DraftMode, TreeBatch
from stree.protocols.tree_layout import LayoutCache
from stree.protocols.tree_shape import TreeShape
from stree.verifier.model.graphed_prefill import PrefillRunner


class DeviceTreeDrafter(DeviceDrafterBase):
    """A draft model's slots and chain/static/beam drafts over them (the engine's ``DeviceDrafter``).

    The slots' state is shared by every tree shape, so the engine can switch shapes step by step. It catches up:
    plain steps may skip it, and ``catch_up`` feeds it what they decoded in one chain pass before its next draft.
    """

    KINDS = ("chain", "static", "beam")
    catches_up = True
    follows_trees = True

    def __init__(self, model, head=None,
                 chain_steps: Optional[bool] = None, beam_steps: Optional[bool] = None):
        self.model = model
        self.head = head  # VocabTrim: a trimmed LM head (logits -inf outside it)
        self.state = None
        self.scratch = None  # chains by steps: the state the steps advance (a copy of ``state`` per draft)
        self.beam_scratch: dict = {}  # beams by steps: M -> two states of B x M rows (sequence b's beams at b*M..)
        self._verified = None  # (TreeBatch, ancestor mask or None): the tree the next commit's path indexes
        self._acts = None  # its commit activations, once computed
        self.layouts: Optional[LayoutCache] = None
        self._attends = any(b.is_attention for b in model.backbone.layers)  # has tree attention masks to make
        pure = all(b.kind == "mamba" for b in model.backbone.layers)  # a state small enough to copy per draft
        self.chain_steps = pure if chain_steps is None else chain_steps and pure
        self.beam_steps = pure if beam_steps is None else beam_steps and pure

    def supports(self, shape: TreeShape) -> bool:
        return shape.kind in self.KINDS

    # ----- slots --------------------------------------------------------------------------------
    def new_slots(self, batch_size: int, max_seqlen: int, device=None) -> None:
        self.state = self.model.new_state(batch_size, max_seqlen)
        self.scratch = self.model.new_state(batch_size, max_seqlen) if self.chain_steps else None
        self.beam_scratch = {}
        self.prefiller = PrefillRunner(self.model, batch_size, max_seqlen)
        self.layouts = LayoutCache(batch_size, self.model.device)

    def park(self, idle: torch.Tensor) -> None:
        """Rewind slots that hold no sequence (``idle`` [B] bool) so they never run out of room."""
        self.state.seqlen.masked_fill_(idle, 0)

    def mutable(self) -> list[torch.Tensor]:
        """The slots' state: what a step advances."""
        return self.state.tensors()

    def warm_up_prefill(self) -> None:
        """Capture the prefill of every (rows, width) bucket (the slots are scratch while no sequence holds one)."""
        self.prefiller.warm_up()

    def _set_shape(self, shape: TreeShape) -> None:
        """Take ``shape``'s layout (depths, node counts, fixed parents and their ancestor mask) from the cache."""
        layout = self.layouts.get(shape, with_ancestors=self._attends)
        self.shape = shape
        self.depth, self.num_nodes, self.static_parents, self.anc = (layout.depth, layout.count, layout.parents,
                                                                     layout.anc)
        self.starts = shape.level_starts()

    def prefill_slot(self, slot: int, context: torch.Tensor) -> None:
        """Make slot ``slot`` hold the draft state after ``context`` (all tokens before the root)."""
        self.prefill_slots([slot], [context])

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        """``prefill_slot`` for many slots at once, in a few batched passes of the draft model."""
        if slots:
            runner = self.prefiller

            def deliver(index, first, _hidden):
                self.state.assign_rows([slots[j] for j in index], runner.scratch.rows(len(index), first))

            runner.run(contexts, deliver)

    # ----- one draft ----------------------------------------------------------------------------
    def _trees(self, tokens: torch.Tensor, parents: torch.Tensor) -> TreeBatch:
        return TreeBatch(tokens, parents, self.depth, self.num_nodes, self.shape.is_chain)

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits outside a trimmed head (VocabTrim) set to -inf."""
        return self.head.mask(logits) if self.head is not None else logits

    def _logits(self, tokens: torch.Tensor, parents: torch.Tensor):
        logits, acts = self.model.tree_forward(self._trees(tokens, parents), self.state, anc_mask=self.anc)
        return self._masked(logits), acts

    def _finish(self, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        """The draft is done: the step verifies this tree (unless told to ``follow`` another)."""
        self._verified, self._acts = (self._trees(tokens, parents), self.anc), None

    def follow(self, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> None:
        """The step verifies these trees (parents chosen per step): the commit replays along them."""
        count = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=tokens.device)
        self._verified, self._acts = (TreeBatch(tokens, parents, depth, count), None), None

    @property
    def acts(self):
        """The commit's activations of the verified tree: a tree pass without the final norm and LM head, run when
        first asked for (by the commit, inside the step)."""
        if self._acts is None:
            trees, anc = self._verified
            self._acts = self.model.tree_forward(trees, self.state, anc_mask=anc, acts_only=True)[1]
        return self._acts

    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        """Trees of ``shape`` rooted at ``roots`` ([B]); ``any_sampled`` (static) says whether Gumbel noise is
        needed."""
        if not self.supports(shape):
            raise ValueError(f"a device draft needs a chain, static or beam tree, not {shape}")
        self._set_shape(shape)
        if shape.kind == "beam":
            if self.beam_steps:
                return self._draft_beam_steps(roots, sampling, any_sampled)
            return self._draft_beam(roots, sampling, any_sampled)
        return self._draft_static(roots, sampling, any_sampled, by_steps=shape.is_chain and self.chain_steps)

    def _draft_static(self, roots, sampling: RowSampling, any_sampled: bool, by_steps: bool = False) -> DeviceDraft:
        """Level by level: each level's rows scored by a tree pass, or (``by_steps``, chains) by a one-token step on a
        scratch copy of the state. Either way ``q`` holds the laws the picks were drawn from."""
        b, dev = roots.shape[0], roots.device
        n, vocab = self.shape.num_nodes, self.model.vocab_size
        parents = self.static_parents
        tokens = torch.zeros(b, n, dtype=torch.long, device=dev)
        tokens[:, 0] = roots
        # greedy steps (static) need neither the warped draft law nor its [B, N, V] copy
        q = torch.zeros(b, n, vocab, device=dev) if any_sampled else None
        sampled = (sampling.temperature > 0)[:, None, None]
        if by_steps:
            self.scratch.copy_from(self.state)
        for d, w in enumerate(self.shape.widths):
            lo, hi = self.starts[d], self.starts[d] + self.shape.level_sizes[d]
            if by_steps:  # a chain's level d is node d alone: the step that feeds it scores its child
                rows = self._masked(self.model.step(tokens[:, d], self.scratch))[:, None]  # [B, 1, V]
            else:
                rows = self._logits(tokens, parents)[0][:, lo:hi]  # [B, F, V]
            probs = None
            if any_sampled:
                probs = sampling.warp(rows)
                q[:, lo:hi] = probs
            picks = pick_children(rows, probs, w, sampled, any_sampled, sampling, d)  # [B, F, w]
            nxt = self.starts[d + 1]
            tokens[:, nxt: nxt + self.shape.level_sizes[d + 1]] = picks.reshape(b, -1)
        # a sampled child the draft gives no mass (support smaller than the width) could never be drawn
        self._finish(tokens, parents)
        return DeviceDraft(tokens, parents, q, DraftMode.WITHOUT_REPLACEMENT)

    def _draft_beam(self, roots, sampling: RowSampling, any_sampled: bool = True) -> DeviceDraft:
        """STree's beam tree: D steps of beam search with M beams; every beam token is a node (point masses)."""
        tokens, parents, scores = self._beam_start(roots)
        for d in range(self.shape.depth):
            lo, hi = self.starts[d], self.starts[d] + self.shape.level_sizes[d]
            logits, _ = self._logits(tokens, parents)
            logq = _beam_log_q(logits[:, lo:hi], sampling, any_sampled)
            scores, _ = self._beam_level(tokens, parents, scores, logq, d)
        self._finish(tokens, parents)
        return DeviceDraft(tokens, parents, None, DraftMode.DETERMINISTIC)

    def _beam_start(self, roots: torch.Tensor):
        """A beam tree's tokens and parents ([B, N], the roots placed) and the root level's score."""
        b, n, dev = roots.shape[0], self.shape.num_nodes, roots.device
        tokens = torch.zeros(b, n, dtype=torch.long, device=dev)
        parents = torch.zeros(b, n, dtype=torch.long, device=dev)
        tokens[:, 0] = roots
        parents[:, 0] = -1
        return tokens, parents, torch.zeros(b, 1, device=dev)

    def _beam_level(self, tokens, parents, scores, logq, d: int):
        """One depth of beam search: the top-M continuations of level ``d``'s beams (``logq`` [B, F, V] added to
        their ``scores`` [B, F]) written as level ``d + 1``'s tokens and parents; returns their scores and each
        one's parent beam within level ``d``."""
        b, m, lo, nxt = tokens.shape[0], self.shape.beams, self.starts[d], self.starts[d + 1]
        vocab = logq.shape[-1]
        top = torch.topk((scores[:, :, None] + logq).reshape(b, -1), m, dim=-1)
        src = torch.div(top.indices, vocab, rounding_mode="floor")
        tokens[:, nxt: nxt + m] = top.indices - src * vocab
        parents[:, nxt: nxt + m] = lo + src
        return top.values, src

    def _beam_rows(self, m: int):
        """Beams by steps: two B x M-row scratch states for width ``m`` (made on first use, kept: captured graphs
        hold their memory) that the depths' steps write in turn, the fan-out index (row b*M+i reads row b, the root's
        step) and each row's sequence offset b*M."""
        b = self.state.batch_size
        if m not in self.beam_scratch:
            dev = self.state.seqlen.device
            offsets = torch.arange(b, device=dev) * m
            self.beam_scratch[m] = (tuple(self.model.new_state(b * m, self.state.max_seqlen) for _ in range(2)),
                                    torch.arange(b, device=dev).repeat_interleave(m), offsets[:, None])
        return self.beam_scratch[m]

    def _draft_beam_steps(self, roots, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        """``_draft_beam`` by decode steps that keep beams in place by index: depth d's step reads each row's parent
        row of the previous depth's state and writes the other scratch state, so no state is copied or gathered.
        The root's step runs one row per sequence (from the slots, into the first B rows of a scratch state); the
        next depth's M beams all read their sequence's row of it (``fan``)."""
        b, m = roots.shape[0], self.shape.beams
        scratch, fan, offsets = self._beam_rows(m)
        tokens, parents, scores = self._beam_start(roots)
        feed, source, rows = roots, self.state, None
        for d in range(self.shape.depth):
            out = scratch[d % 2].rows(b) if d == 0 else scratch[d % 2]
            logits = self._masked(self.model.step(feed, out, source=source, source_rows=rows))
            logits = logits.view(b, -1, logits.shape[-1])  # [B, F, V]: level 0 is the root alone
            scores, src = self._beam_level(tokens, parents, scores, _beam_log_q(logits, sampling, any_sampled), d)
            if d + 1 < self.shape.depth:
                source, rows = scratch[d % 2], fan if d == 0 else (offsets + src).reshape(-1)
                feed = tokens[:, self.starts[d + 1]: self.starts[d + 1] + m].reshape(-1)
        self._finish(tokens, parents)
        return DeviceDraft(tokens, parents, None, DraftMode.DETERMINISTIC)

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Feed the root and the accepted nodes (``path`` from the last draft's tree) by replay."""
        self.model.commit(self.state, self.acts, path, path_len)

    def step_roots(self, roots: torch.Tensor) -> None:
        """Plain decoding steps: feed just the roots, so the draft state keeps up."""
        self.model.step(roots, self.state)

    def catch_up(self, backlog: torch.Tensor, count: torch.Tensor) -> None:
        """Feed each slot's first ``count[b]`` tokens of ``backlog`` ``[B, L]`` in one chain pass + replay.

        The engine's plain steps leave the draft behind instead of stepping it token by token; before
        the next draft it catches up here, at the cost of one draft tree pass for up to L tokens.
        """
        n = backlog.shape[1]
        layout = self.layouts.chain(n, with_ancestors=self._attends)
        parents, path, num_nodes, anc = layout.parents, layout.depth, layout.count, layout.anc
        _, acts = self.model.tree_forward(TreeBatch(backlog, parents, path, num_nodes, is_chain=True), self.state,
                                          anc_mask=anc, acts_only=True)
        self.model.commit(self.state, acts, path, count, min_len=0)


def _beam_log_q(logits: torch.Tensor, sampling: RowSampling, any_sampled: bool = True) -> torch.Tensor:
    """Beam scores: log-softmax of the raw logits for greedy rows, log of the shared warp for sampled rows
    (``any_sampled`` False: every row is greedy, so the warp is skipped)."""
    greedy = torch.log_softmax(logits.float(), -1)
    if not any_sampled:
        return greedy
    warped = torch.log(sampling.warp(logits))
    return torch.where((sampling.temperature > 0)[:, None, None], warped, greedy)
