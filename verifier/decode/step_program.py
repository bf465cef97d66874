"""The device code of one engine step, for every step kind: what a CUDA graph captures and replays.

Buffers are allocated once for B slots: the target's state, each slot's root (the last chosen token, not yet fed),
which slots are idle, each row's sampling, and the step's output (per row its emitted tokens, then their count) in
one tensor, so the host reads a step back with one copy. The bodies take everything from these buffers and
write their results back into them, so a graph captured once replays for any sequences in the slots.
"""

from __future__ import annotations

import random

from typing import Callable, Optional

import torch
from torch.profiler import record_function

from stree.kernels import ops
from stree.kernels.keyed_random import ACCEPT_LANE, BONUS_LANE
from stree.protocols.sampling import RowSampling, SamplingParams
from stree.protocols.token_tree import DraftMode, TreeBatch
from stree.protocols.tree_layout import LayoutCache, fixed_parents
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.drafter_slots import DrafterSlots
from stree.verifier.decode.host_trees import HostTrees
from stree.verifier.decode.step_graphs import CATCH_UP, HOST, PLAIN, StepKey
from stree.verifier.decode.verify_device import verify_batch
from stree.verifier.model.lm import StreeLM

PLAIN_SHAPE = TreeShape.parse("none")


class StepProgram:
    """The target's slots and the step bodies over them (``body(key)``); ``drafter`` / ``host`` as the engine has."""

    def __init__(self, model: StreeLM, batch: int, max_seqlen: int, out_width: int,
                 drafter: Optional[DrafterSlots], host: Optional[HostTrees]):
        dev = model.device
        self.model, self.batch, self.device = model, batch, dev
        self.drafter, self.host = drafter, host
        self.state = model.new_state(batch, max_seqlen)
        self.roots = torch.zeros(batch, dtype=torch.long, device=dev)
        self.idle = torch.ones(batch, dtype=torch.bool, device=dev)
        self.sampling = RowSampling.greedy(batch, dev)
        self.out = torch.zeros(batch, out_width + 2, dtype=torch.long, device=dev)
        self.out_tokens, self.out_counts = self.out[:, : out_width + 1], self.out[:, out_width + 1]
        self.layouts = LayoutCache(batch, dev)
        self.seeds = random.Random(0)  # where a request that brings no seed gets one (``reseed``)
        self.moved = False  # the last eagerly run body began to change state (before that, a failure loses nothing)

    def mutable(self) -> list[torch.Tensor]:
        """Every tensor a step advances: restored after a graph capture's warm-up runs."""
        tensors = [self.roots, self.out, self.sampling.step] + self.state.tensors()
        return tensors + (self.drafter.mutable() if self.drafter is not None else [])

    def reseed(self, seed: int) -> None:
        """Draw the seeds of requests that bring none from ``seed``."""
        self.seeds = random.Random(seed)

    def start_row(self, row: int, params: SamplingParams) -> None:
        """Give slot ``row`` a joining request's sampling: its parameters, and its seed (or a fresh one drawn from
        ``seeds``) keying every draw of the row from its first step."""
        self.sampling.set_row(row, params)
        self.sampling.start(row, params.seed if params.seed is not None else self.seeds.getrandbits(63))

    def set_idle(self, idle: list[bool]) -> None:
        """Mark which slots hold no sequence; an idle slot's root is 0 (its rows compute, but on nothing of anyone's)."""
        self.idle.copy_(torch.tensor(idle, device=self.device))
        self.roots.masked_fill_(self.idle, 0)

    def body(self, key: StepKey) -> Callable[[], None]:
        """The step ``key`` names, as a function of no arguments (what a graph captures)."""
        if key.kind == PLAIN:
            run = lambda: self._plain(key.sampled, key.feed)  # noqa: E731
        elif key.kind == CATCH_UP:
            run = lambda: (self._moving(), self.drafter.catch_up())  # noqa: E731
        elif key.kind == HOST:
            run = lambda: self._host(key)  # noqa: E731
        else:
            run = lambda: self._device_tree(key.shape, key.sampled)  # noqa: E731
        return lambda: (self._start(), run())

    def isolate(self, key: StepKey, rows: list[int]) -> Optional[int]:
        """After ``key`` failed without moving any state: run it again with each of ``rows`` set aside in turn. The
        first row whose removal lets it run is returned (the other rows took their step); None when no single row
        does, or a failed re-run began to move state."""
        body = self.body(key)
        for row in rows:
            undo = self.set_aside(row, key)
            try:
                body()
            except Exception:  # noqa: BLE001 - not this row
                if self.moved:
                    return None
                undo()
                continue
            return row
        return None

    def set_aside(self, row: int, key: StepKey) -> Callable[[], None]:
        """Make ``row`` harmless for a re-run of ``key`` (root 0, greedy, a host tree of its root alone); returns
        what undoes it. Only after a failed run that moved nothing."""
        sampling = self.sampling
        root = int(self.roots[row])
        saved = [t[row].clone() for t in (sampling.temperature, sampling.top_k, sampling.top_p)]
        filtered = row in sampling.filtered_rows
        self.roots[row] = 0
        sampling.set_row(row, SamplingParams())
        tree = self.host.trees[:, row].clone() if key.kind == HOST else None
        if tree is not None:
            self.host.trees[:, row, 0] = 0
            self.host.trees[3, row, 1:] = 0

        def undo() -> None:
            self.roots[row] = root
            for t, v in zip((sampling.temperature, sampling.top_k, sampling.top_p), saved):
                t[row] = v
            if filtered:
                sampling.filtered_rows.add(row)
            if tree is not None:
                self.host.trees[:, row].copy_(tree)

        return undo

    def _start(self) -> None:
        self.moved = False

    def _moving(self) -> None:
        self.moved = True

    # ----- the bodies ------------------------------------------------------------------------------
    def _plain(self, sampled: bool, feed: bool) -> None:
        self._moving()
        logits, hidden = self.model.step(self.roots, self.state, return_hidden=True)
        if self.drafter is not None:
            self.drafter.on_plain_step(self.roots, hidden, feed)
        layout = self.layouts.get(PLAIN_SHAPE)
        res = self._verify(self.roots[:, None], layout.parents, layout.valid, logits[:, None],
                           DraftMode.DETERMINISTIC, None, 0, 1, sampled)
        lazy = self.drafter is not None and self.drafter.lazy
        self._finish(res, moved=not lazy, fed=feed)  # a lazy drafter did not move, its backlog only if fed

    def _device_tree(self, shape: TreeShape, sampled: bool) -> None:
        slots: DrafterSlots = self.drafter
        with record_function("stree.draft"):
            draft = slots.drafter.draft(shape, self.roots, self.sampling, sampled)
        layout = self.layouts.get(shape, with_ancestors=fixed_parents(shape))
        valid = layout.valid if draft.valid is None else draft.valid
        res = self._verify_commit(draft.tokens, draft.parents, layout.depth, layout.count, valid,
                                  draft.q if sampled else None, draft.mode if sampled else DraftMode.DETERMINISTIC,
                                  shape.max_depth, shape.max_width, sampled, shape.is_chain, layout.anc)
        with record_function("stree.draft_commit"):
            slots.drafter.commit(res.path, res.path_len)
        self._finish(res, moved=True, fed=True)

    def _host(self, key: StepKey) -> None:
        tokens, parents, depth, valid = self.host.view(key.shape)
        q = self.host.q if key.with_q else None
        budget = self.host.budget
        res = self._verify_commit(tokens, parents, depth, valid.sum(-1), valid, q, key.mode, budget.max_depth,
                                  budget.max_width, key.sampled)
        self._finish(res, moved=True, fed=True)

    # ----- shared parts ------------------------------------------------------------------------------
    def _verify_commit(self, tokens, parents, depth, count, valid, q, mode, max_depth: int, max_width: int,
                       sampled: bool, is_chain: bool = False, anc: Optional[torch.Tensor] = None):
        trees = TreeBatch(tokens, parents, depth, count, is_chain)
        with record_function("stree.target_tree_pass"):
            logits, acts, hidden = self.model.tree_forward(trees, self.state, anc_mask=anc, return_hidden=True)
        with record_function("stree.verify"):
            res = self._verify(tokens, parents, valid, logits, mode, q, max_depth, max_width, sampled)
        self._moving()
        with record_function("stree.target_commit"):
            self.model.commit(self.state, acts, res.path, res.path_len)
        if self.drafter is not None:
            self.drafter.observe_accepted(hidden, res.path, res.path_len)
        return res

    def _verify(self, tokens, parents, valid, logits, mode, q, max_depth, max_width, sampled):
        n, rows = tokens.shape[1], self.sampling
        if sampled:  # keyed by each row's request and step alone: the same draws whatever shares the batch
            u, bonus_u = (ops.keyed_uniform(rows.seed, rows.step, lane, n) for lane in (ACCEPT_LANE, BONUS_LANE))
        else:
            u = bonus_u = torch.zeros(self.batch, n, device=self.device)
        return verify_batch(tokens, parents, valid, logits, rows.temperature, *rows.filters(),
                            mode, q, u, bonus_u, max_depth=max_depth, max_width=max_width, sampling=sampled)

    def _finish(self, res, moved: bool, fed: bool) -> None:
        """Publish the step's tokens and next roots; rewind idle slots."""
        width = res.out_tokens.shape[1]
        self.out_tokens[:, :width].copy_(res.out_tokens)
        self.out_counts.copy_(res.num_out)
        self.roots.copy_(res.bonus)
        self.roots.masked_fill_(self.idle, 0)
        self.sampling.advance()
        self.state.seqlen.masked_fill_(self.idle, 0)
        if self.drafter is not None:
            self.drafter.park(self.idle, moved, fed)

