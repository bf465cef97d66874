"""When queued prompts join: the admission hold rule and the measured costs it weighs.

With more prompts waiting than slots free, admitting into each slot as soon as it frees costs one prefill pass per
prompt, while one pass over several prompts costs little more than a pass over one. Speculative rows finish on different steps, so the engine may
keep free slots empty for a few steps while a running sequence is about to finish: each held step idles
``free / batch`` of a step's work, and the hold stops once that adds up to one admission's measured cost (or at
the ``admit_hold_steps`` cap, which bounds the time to first token).
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
import time
from typing import Iterable, Optional

from stree.verifier.decode.slot_table import SlotTable
from stree.verifier.model.graphed_prefill import PrefillRunner

log = logging.getLogger(__name__)


@dataclass
class AdmissionCosts:
    """Running means of the seconds one admission (its prefill passes) and one step take, as the engine measures
    them (CUDA events per step on the GPU, wall time otherwise); ``alpha`` weighs the newest sample."""

    admit_s: Optional[float] = None
    step_s: Optional[float] = None
    alpha: float = 0.2

    def observe_admit(self, seconds: float) -> None:
        self.admit_s = self._mean(self.admit_s, seconds)

    def observe_step(self, seconds: float) -> None:
        self.step_s = self._mean(self.step_s, seconds)

    def _mean(self, mean: Optional[float], sample: float) -> float:
        return sample if mean is None else mean + self.alpha * (sample - mean)

    def hold_steps(self, free: int, batch: int, cap: int) -> int:
        """Steps ``free`` of ``batch`` slots may stay empty before their idle share of the steps outweighs one
        admission; at most ``cap``; 0 until both costs were measured."""
        if self.admit_s is None or not self.step_s or free < 1:
            return 0
        return min(cap, int(self.admit_s * batch / (self.step_s * free)))  # costs are >= 0, and so is cap


def check_hold_steps(steps) -> int:
    """``admit_hold_steps`` as an int, or ValueError for anything but an integer >= 0."""
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"admit_hold_steps must be an integer >= 0, got {steps!r}")
    return int(steps)


def steps_to_finish(tokens_left: int, tokens_so_far: int, steps_so_far: int) -> float:
    """Expected steps until a sequence reaches its token limit, at its tokens per step so far (at least 1)."""
    rate = max(1.0, tokens_so_far / steps_so_far) if steps_so_far else 1.0
    return tokens_left / rate


def should_hold(waiting: int, free: int, held: int, budget: int, running: Iterable[float]) -> bool:
    """Keep the free slots empty this step: more prompts wait than fit, the budget (in steps) is not spent, and
    some running sequence should finish within what is left of it (``running``: their ``steps_to_finish``)."""
    left = budget - held
    return left > 0 and waiting > free and any(steps <= left for steps in running)


class Admission:
    """Joining sequences' prefill into the target's slots, between steps, and the hold rule's state.

    The joining prompts (every token before each root) run through the model in a few batched passes (one CUDA
    graph per rows x width bucket); each sequence's state is written into its slot. A prompt whose prefill fails is
    ended with an error and the others join.
    """

    def __init__(self, model, batch: int, max_seqlen: int, chunk: int, cuda_graphs: bool, hold_steps: int):
        if chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {chunk}")
        self.prefiller = PrefillRunner(model, batch, max_seqlen, chunk, cuda_graphs=cuda_graphs)
        self.batch = batch
        self.costs = AdmissionCosts()
        self.hold_steps = check_hold_steps(hold_steps)
        self.held = 0  # steps the free slots have waited so far

    def admit(self, table: SlotTable, program, drafter) -> tuple[Optional[float], bool]:
        """Fill free slots of ``table`` from its queue unless the hold rule keeps them empty this step; returns the
        seconds the admission took (None when nothing was admitted) and whether the hold rule held them."""
        free = table.free()
        if not free or not table.waiting:
            self.held = 0
            return None, False
        running = (steps_to_finish(r.max_new_tokens - len(r.output), len(r.output), r.steps)
                   for r in table.slots if r is not None and not r.done)
        if should_hold(len(table.waiting), len(free), self.held,
                       self.costs.hold_steps(len(free), self.batch, self.hold_steps), running):
            self.held += 1
            return None, True
        self.held = 0
        t0 = time.perf_counter()
        groups = [table.next_waiting(len(free))]
        while groups:
            group = groups.pop()
            try:
                joined = self._join(group, free[: len(group)], table, program, drafter, t0)
            except Exception as exc:  # noqa: BLE001 - one prompt must not keep the others out
                if len(group) > 1:
                    groups += [[r] for r in group]  # find the one that fails: each alone
                else:
                    log.warning("prefill of request %r failed: %r", group[0].request_id, exc)
                    group[0].fail(f"prefill failed: {exc}")
                continue
            free = [i for i in free if i not in joined]
        elapsed = time.perf_counter() - t0
        self.costs.observe_admit(elapsed)
        return elapsed, False

    def _join(self, group: list, slots: list[int], table: SlotTable, program, drafter, t0: float) -> list[int]:
        """Prefill ``group`` into ``slots``; returns the slots taken (requests cancelled meanwhile take none)."""
        observes = drafter is not None and drafter.observes
        hidden: dict = {}

        def deliver(index, first, hid):
            program.state.assign_rows([slots[j] for j in index], self.prefiller.scratch.rows(len(index), first))
            if observes:
                for k, j in enumerate(index):
                    hidden[j] = hid[k].clone()

        if not self.prefiller.run([r.prompt_ids[:-1] for r in group], deliver,
                                  keep_going=lambda: any(not r.done for r in group)):
            return []
        picked = [j for j, r in enumerate(group) if not r.done]
        taken = [slots[j] for j in picked]
        if drafter is not None:
            drafter.join(taken, [group[j].prompt_ids[:-1] for j in picked])
        seconds = time.perf_counter() - t0
        for j, i in zip(picked, taken):
            req = group[j]
            if drafter is not None:
                drafter.observe_joined(hidden.get(j), i)
            program.roots[i] = req.prompt_ids[-1]
            req.root_token = req.prompt_ids[-1]
            program.start_row(i, req.params)
            req.admitted, req.prefill_s = True, seconds
        table.take([(i, group[j]) for j, i in zip(picked, taken)])
        return taken
