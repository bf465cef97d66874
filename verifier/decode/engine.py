"""The batched speculative engine: B sequence slots, one device-resident step for all of them.

A step is draft -> target tree pass -> verification -> both commits, as tensor code over ``[slots, nodes]`` with
fixed shapes per tree shape (``step_program.py``), so on CUDA it is one graph replay per step (``step_graphs.py``).
The host reads back only the emitted tokens and their counts, asynchronously (``step_readback.py``): step k+1 is
launched before step k's tokens are read, so the host's bookkeeping overlaps the GPU. Sequences join (a prefill
into a free slot, ``admission.py``) and leave (stop token, token limit, cancel, error) between steps. A device
drafter's slots are kept by ``drafter_slots.py``; host drafters' trees are staged by ``host_trees.py``; the shape of
each step comes from ``step_choice.py`` (fixed, or goodput control).

A step that raises before it moved any state (while drafting, in the target's tree pass, in verification) is run
again with one running sequence at a time set aside; the sequence whose removal lets it run ends with
``finish_reason`` ``error`` and the others take their step. A failure after the state began to move ends every
running sequence: their state cannot be restored without copying it every step.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stree.protocols.device_drafter import DeviceDrafter
from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.admission import Admission
from stree.verifier.decode.drafter_slots import CATCH_UP, DrafterSlots
from stree.verifier.decode.host_trees import HostTrees, bucket, close_quietly, commit_or_drop
from stree.verifier.decode.request import Request
from stree.verifier.decode.slot_table import SlotTable
from stree.verifier.decode.step_choice import StepChooser
from stree.verifier.decode.step_graphs import CATCH_UP as CATCH_UP_STEP, HOST, PLAIN, TREE, StepGraphs, StepKey
from stree.verifier.decode.step_program import StepProgram
from stree.verifier.decode.step_readback import StepReadback
from stree.verifier.model.lm import StreeLM

log = logging.getLogger(__name__)

PLAIN_SHAPE = TreeShape.parse("none")
ADMIT_HOLD_STEPS = 32
"""At most this many steps free slots stay empty while more prompts wait than fit and a running sequence is about to
finish, so that queued prompts share one prefill (``admission.py``: the measured costs set the hold below this cap)."""


@dataclass
class Launched:
    """A step whose outputs are still on their way to the host."""

    key: StepKey
    shape: TreeShape
    slots: list  # the request in each slot when the step was launched (None: idle)
    turn: int  # the readback buffer it lands in
    host_s: float
    drafted: int
    measured: bool = True  # False when the step also captured a graph or was re-run: its time is no cost sample
    refresh_s: float = 0.0  # the drafter refresh this step needed first (wall seconds): part of its cost
    refreshed: int = 0  # sequences that refresh prefilled


def engine_shapes(shapes, drafter: Optional[DeviceDrafter], host: bool, budget: DraftBudget) -> list[TreeShape]:
    """The shapes an engine chooses among (plain decoding when none is given), checked against its drafter."""
    out = [s if isinstance(s, TreeShape) else TreeShape.parse(s) for s in shapes] or [PLAIN_SHAPE]
    for s in out:
        if s.kind == "dynamic":
            raise ValueError("dynamic trees have no fixed layout: use a host drafter for them")
        if s.kind != "none" and drafter is not None and not drafter.supports(s):
            raise ValueError(f"the drafter cannot lay out {s} trees")
        if s.kind != "none" and drafter is None and not host:
            raise ValueError(f"tree {s} needs a drafter")
    if host:
        out = [PLAIN_SHAPE, TreeShape("host", nodes=bucket(budget.max_nodes))]
    return list(dict.fromkeys(out))


class Engine:
    """B slots of target state (and of a device drafter's state), stepped together.

    ``drafter`` is None (plain decoding), a ``DeviceDrafter`` (its whole draft runs in the step graph), or ``"host"``,
    in which case each request brings its own ``drafter_session``. ``shapes``: the tree shapes to choose from each
    step (``goodput=True`` picks the one with the best expected tokens per second, plain decoding included); the
    first is used otherwise.
    """

    def __init__(self, model: StreeLM, drafter=None, shapes: Sequence[TreeShape | str] = (),
                 max_batch: int = 8, max_seqlen: int = 4096, cuda_graphs: Optional[bool] = None,
                 goodput: bool = False, budget: DraftBudget = DEFAULT_BUDGET, seed: Optional[int] = None,
                 overlap: bool = True, prefill_chunk: int = 512, admit_hold_steps: int = ADMIT_HOLD_STEPS):
        if int(max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.device, self.batch, self.budget = model, model.device, int(max_batch), budget
        self.host = drafter == "host"
        device_drafter = None if drafter is None or self.host else drafter
        self.shapes = engine_shapes(shapes, device_drafter, self.host, budget)
        self.max_nodes = max([s.num_nodes for s in self.shapes] + ([budget.max_nodes] if self.host else []))
        # every step writes up to max_nodes KV rows past a slot's length; one extra step runs after a finish
        self.max_seqlen = int(max_seqlen) + 2 * (self.max_nodes + 1) + CATCH_UP
        self.cuda = self.device.type == "cuda"
        graphs_on = self.cuda if cuda_graphs is None else (bool(cuda_graphs) and self.cuda)
        self.overlap = overlap and self.cuda
        goodput = bool(goodput) and len(self.shapes) > 1  # one shape leaves nothing to choose
        self.drafter = (DrafterSlots(device_drafter, self, self.batch, self.max_seqlen, self.device, defer=goodput)
                        if device_drafter is not None else None)
        self.host_trees = (HostTrees(self.batch, self.max_nodes, budget, model.vocab_size, self.device)
                           if self.host else None)
        width = max(self.max_nodes, budget.max_depth, *(s.max_depth for s in self.shapes if s.kind != "host"))
        self.program = StepProgram(model, self.batch, self.max_seqlen, width, self.drafter, self.host_trees)
        self.admission = Admission(model, self.batch, self.max_seqlen, prefill_chunk, graphs_on, admit_hold_steps)
        self.chooser = StepChooser(self.shapes, self.host, goodput, self.drafter is not None and self.drafter.defer,
                                   lambda: self.admission.costs.admit_s)
        self.graphs = StepGraphs(graphs_on, self.device, self.program.mutable, self.chooser.captured)
        self.readback = StepReadback(self.program.out, self.cuda)
        self.table = SlotTable(self.batch, self._released, self.program.set_idle)
        self.slots, self.waiting = self.table.slots, self.table.waiting
        self.pending: collections.deque[Launched] = collections.deque()
        self.metrics = collections.Counter()
        self.step_host_s: list[float] = []
        self.warmed_up = False  # warm_up captured every step graph
        self.reseed(seed)

    @property
    def goodput(self):
        """The goodput controller (None without goodput control)."""
        return self.chooser.goodput

    def inherit_acceptance(self, other: "Engine") -> None:
        """Start goodput control from what ``other`` (an engine over the same drafter) learned of acceptance."""
        self.chooser.inherit(other.chooser)

    def reseed(self, seed: Optional[int]) -> None:
        """Where requests that bring no seed of their own get one: drawn from ``seed`` (a seeded run is reproducible
        for the same prompts in the same order), or from torch's global generator (None). A request's draws depend
        only on its seed and its own steps."""
        seed = int(torch.randint(0, 2**62, (1,))) if seed is None else int(seed)
        self.program.reseed(seed)

    # ----- requests ------------------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        """Queue a request; it joins a free slot at the next step boundary."""
        prompt, vocab = request.prompt_ids, self.model.vocab_size
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        room = self.max_seqlen - 2 * (self.max_nodes + 1) - CATCH_UP
        if len(prompt) + request.max_new_tokens > room:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({request.max_new_tokens}) is over "
                             f"the engine's {room} tokens per sequence")
        if self.host and request.drafter_session is None:
            raise ValueError("a host-drafter engine needs each request's drafter_session")
        self.waiting.append(request)
        return request

    @property
    def num_running(self) -> int:
        return self.table.num_running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.table.num_running > 0 or bool(self.pending)

    def fail_all(self, message: str) -> None:
        """End every request in the engine (running, waiting, in flight) with ``message``; every slot is freed."""
        for req in [r for r in self.slots if r is not None] + list(self.waiting):
            req.fail(message)
        self.pending.clear()
        self.waiting.clear()
        self.table.drop_finished()

    def _released(self, slot: int, req: Request) -> None:
        self.chooser.released(req)
        if self.drafter is not None:
            self.drafter.leave(slot)
        if req.drafter_session is not None:
            close_quietly(req)

    # ----- one engine step (host side) ---------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Admit, launch one step for every slot, and emit what the previous step produced.

        Returns ``(request, new tokens)`` pairs; finished requests have left their slots.
        """
        t0 = time.perf_counter()
        if self.drafter is not None and not self.drafter.owned:
            raise RuntimeError("another engine was built over this engine's device drafter and holds its state now; "
                               "give each engine its own drafter")
        self.table.drop_finished()
        admitted_s, held = self.admission.admit(self.table, self.program, self.drafter)
        if held:
            self.metrics["admission_holds"] += 1
        if admitted_s is not None:
            self.metrics["admit_s"] += admitted_s
            self.chooser.guess_refresh()
        emitted: list = []
        if self.num_running:
            sampled = self.table.any_sampled()
            shape = self._choose(sampled)
            refresh_s, refreshed = 0.0, 0
            if shape.kind not in ("none", "host") and self.drafter.stale_among(self.table.running()):
                while self.pending:  # collect every step in flight: the host then knows each sequence to its root
                    emitted += self._collect(self.pending.popleft())
                t1 = time.perf_counter()
                refreshed = self._refresh_drafter()
                refresh_s = time.perf_counter() - t1
                self.metrics["refresh_s"] += refresh_s
            if self.num_running:
                launched = self._launch(t0, shape, sampled)
                launched.refresh_s, launched.refreshed = refresh_s, refreshed
                self.pending.append(launched)
        while self.pending and (len(self.pending) > 1 or not self.overlap or not self.num_running or self.host):
            emitted += self._collect(self.pending.popleft())
        return emitted

    def _refresh_drafter(self) -> int:
        """Prefill the stale drafter slots of running sequences from their whole sequence; returns how many."""
        slots = self.drafter.stale_among(self.table.running())
        self.drafter.refresh(slots, [self.slots[i].context for i in slots])
        self.metrics["drafter_refreshes"] += len(slots)
        return len(slots)

    def _choose(self, sampled: bool = False) -> TreeShape:
        running = [r for r in self.slots if r is not None]
        shape, drained = self.chooser.choose(sampled, running, len(self.waiting))
        if drained:
            self.metrics["drain_plain_steps"] += 1
        return shape

    def _launch(self, t0: float, shape: TreeShape, sampled: bool) -> Launched:
        filtered = sampled and self.program.sampling.filtered  # a graph with or without the top-k/top-p sorts
        drafted = shape.num_nodes - 1
        if shape.kind == "none":
            feed = self.drafter is not None and self.drafter.before_plain(self.table.running())
            key = StepKey(PLAIN, sampled=sampled, filtered=filtered, feed=feed)
        elif shape.kind == "host":
            staged = self.host_trees.stage(self.slots, sampled)
            shape, drafted = staged.shape, staged.drafted
            key = StepKey(HOST, shape, sampled, filtered, mode=staged.mode, with_q=staged.with_q)
        else:
            key = StepKey(TREE, shape, sampled, filtered)
        captured = len(self.graphs)
        turn = self.readback.start()
        clean = True
        if key.kind == TREE and self.drafter.needs_catch_up():
            clean = self._run(StepKey(CATCH_UP_STEP))
            self.drafter.caught_up()
        clean = self._run(key) and clean
        if key.kind == PLAIN and self.drafter is not None:
            self.drafter.after_plain(key.feed)
        self.readback.finish(turn)
        return Launched(key, shape, list(self.slots), turn, time.perf_counter() - t0, drafted,
                        measured=clean and len(self.graphs) == captured)

    def _run(self, key: StepKey) -> bool:
        """Run the step ``key``; False when it failed and the sequence that made it fail was set aside."""
        try:
            self.graphs.run(key, self.program.body(key))
            return True
        except Exception as exc:  # noqa: BLE001 - one sequence must not end the others
            log.warning("engine step %s failed (%r); looking for the sequence that causes it", key.kind, exc)
            self.metrics["step_failures"] += 1
            error = exc
        culprit = self.program.isolate(key, self.table.running()) if not self.program.moved else None
        failed = [culprit] if culprit is not None else self.table.running()
        for i in failed:
            self.slots[i].fail(f"the engine's step failed on this request: {error}" if culprit is not None
                               else f"the engine's step failed: {error}")
        return False

    def _collect(self, step: Launched) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        rows = self.readback.read(step.turn)  # each row's tokens, then their count last
        t1 = time.perf_counter()
        out, accepted = [], []
        for i, req in enumerate(step.slots):
            if req is None or req.done:
                continue
            new = rows[i][: rows[i][-1]]
            req.record_step(new, step.drafted if step.key.kind != HOST else req.host_drafted)
            accepted.append(len(new))
            got = req.emit(new)
            if req.drafter_session is not None and not req.done:
                commit_or_drop(req, new)
            if got:
                out.append((req, got))
                if req.on_tokens is not None:
                    req.on_tokens(req, got)
        self.table.drop_finished()
        self.step_host_s.append(step.host_s + (time.perf_counter() - t1))
        seconds = self.readback.seconds(step.turn)
        m = self.metrics
        m["steps"] += 1
        m["waited_s"] += t1 - t0
        m["gpu_s"] += seconds
        m[f"steps:{step.shape}"] += 1  # per shape: where a goodput run spends its time
        m[f"gpu_s:{step.shape}"] += seconds
        if step.measured:  # a step that captured a graph is no sample of what the step costs
            self.admission.costs.observe_step(seconds)
        self.chooser.observe(step.shape, step.key.sampled, seconds, accepted, step.drafted, step.measured,
                             step.refresh_s, step.refreshed)
        return out

    # ----- whole runs ---------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[Request]:
        """Add ``requests`` and step until all of them are done."""
        for r in requests:
            self.add(r)
        while self.has_work:
            self.step()
        return list(requests)

    def warm_up_prefill(self) -> None:
        """Prefill once at every (rows, width) bucket, target and draft model, so that no request waits on a
        kernel compile or a graph capture for its prompt length or batch. Only while no sequence is in the engine."""
        if self.has_work:
            return
        self.admission.prefiller.warm_up()
        if self.drafter is not None:
            self.drafter.drafter.warm_up_prefill()

    def warm_up(self) -> int:
        """Capture every step graph now (``warm_up.py``); returns the graphs held."""
        from stree.verifier.decode.warm_up import warm_up_engine

        return warm_up_engine(self)

    @property
    def host_step_stats(self) -> dict:
        """Host time per step (launch + bookkeeping, excluding waits for the GPU), in microseconds."""
        xs = sorted(self.step_host_s)
        if not xs:
            return {}
        return {"host_us_p50": 1e6 * xs[len(xs) // 2], "host_us_mean": 1e6 * sum(xs) / len(xs),
                "host_us_p90": 1e6 * xs[int(0.9 * (len(xs) - 1))]}


__all__ = ["ADMIT_HOLD_STEPS", "CATCH_UP", "Engine", "Launched", "Request"]
