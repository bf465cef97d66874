"""A device drafter's B slots as the engine keeps them: in step, behind by a backlog, or stale.

A drafter that ``catches_up`` (a draft model) need not follow plain steps: each plain step writes its roots to a
backlog instead, and before the next draft one ``catch_up`` pass feeds the drafter the whole backlog. Past
``CATCH_UP`` tokens the backlog is dropped and the running slots go stale; a stale slot is prefilled afresh from its
sequence (prompt and output before the root) when a draft is chosen again, which costs only when drafting resumes.
Under goodput control (``defer``) a joining sequence's slot starts stale too: the drafter is not prefilled at all
while plain steps win. Other drafters step with every plain step (``step_roots``).
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.protocols.device_drafter import DeviceDrafter

CATCH_UP = 16
"""Plain steps a lazy drafter may fall behind before its slots go stale (the backlog's length)."""
REFRESH_PROBE_TOKENS = 256
"""Context length of the refresh ``time_refresh`` times: goodput control's first guess of what a refresh costs."""


class DrafterSlots:
    """``drafter``'s slots for ``batch`` sequences (claimed for ``owner``, the engine) and their bookkeeping."""

    def __init__(self, drafter: DeviceDrafter, owner: object, batch: int, max_seqlen: int, device, defer: bool):
        self.drafter = drafter
        self.owner = owner
        drafter.claim(owner)
        drafter.new_slots(batch, max_seqlen, device)
        self.lazy = bool(drafter.catches_up)
        self.observes = bool(drafter.observes_target)
        self.defer = defer and self.lazy  # prefill only when a draft is chosen, not at admission
        # idle slots count as stale, so ``live`` asks whether some running slot's drafter holds its sequence
        self.stale = [True] * batch
        self.behind = 0  # plain steps since the last catch-up (host count; an upper bound per slot)
        self.backlog = torch.zeros(batch, CATCH_UP, dtype=torch.long, device=device)
        self.backlog_len = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def owned(self) -> bool:
        """False once another engine claimed the drafter (its slot state is that engine's now)."""
        return self.drafter.claimed_by(self.owner)

    def mutable(self) -> list[torch.Tensor]:
        return [self.backlog, self.backlog_len] + list(self.drafter.mutable())

    # ----- host side: between steps ---------------------------------------------------------------
    def join(self, slots: list[int], contexts: list) -> None:
        """Sequences took ``slots`` (``contexts``: every token before each root): prefilled now unless deferred."""
        if not self.defer:
            self.drafter.prefill_slots(slots, contexts)
        self.backlog_len[slots] = 0
        for i in slots:
            self.stale[i] = self.defer

    def leave(self, slot: int) -> None:
        self.stale[slot] = True

    def before_plain(self, running: list[int]) -> bool:
        """Ready a plain step; returns whether it feeds the backlog. A full backlog is dropped and the running slots
        go stale: a plain run may go on for long, and catching up then would cost more than a refresh later."""
        if not self.lazy:
            return False
        if self.behind >= CATCH_UP:
            for i in running:
                self.stale[i] = True
            self.backlog_len.zero_()
            self.behind = 0
        return False in self.stale

    def after_plain(self, fed: bool) -> None:
        if fed:
            self.behind += 1

    def needs_catch_up(self) -> bool:
        """Whether a draft must first feed the drafter its backlog (then ``caught_up``)."""
        return self.lazy and self.behind > 0

    def caught_up(self) -> None:
        self.behind = 0

    def stale_among(self, running: list[int]) -> list[int]:
        return [i for i in running if self.stale[i]]

    def refresh(self, slots: list[int], contexts: list) -> None:
        """Prefill stale ``slots`` from their whole sequence before the root (``contexts``)."""
        self.drafter.prefill_slots(slots, contexts)
        for i in slots:
            self.stale[i] = False
        self.backlog_len[slots] = 0

    def time_refresh(self, max_seqlen: int, cuda: bool) -> float:
        """Wall seconds of refreshing slot 0 with a ``REFRESH_PROBE_TOKENS``-token context (the second of two runs:
        the first may compile). Only while no sequence holds a slot; slot 0 is stale afterwards."""
        import time

        context = [0] * max(1, min(REFRESH_PROBE_TOKENS, max_seqlen // 2))
        seconds = 0.0
        for _ in range(2):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.drafter.prefill_slots([0], [context])
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        self.stale[0] = True
        return seconds

    # ----- device side: inside the step graph ----------------------------------------------------
    def on_plain_step(self, roots: torch.Tensor, hidden: torch.Tensor, feed: bool) -> None:
        """A plain step fed ``roots`` to the target: backlog them (lazy drafter), or step the drafter with them."""
        if self.lazy:
            if feed:
                self.backlog.scatter_(1, self.backlog_len.clamp(max=CATCH_UP - 1)[:, None], roots[:, None])
                self.backlog_len += 1
            return
        self.drafter.step_roots(roots)
        if self.observes:
            self.drafter.observe_target(hidden)

    def catch_up(self) -> None:
        self.drafter.catch_up(self.backlog, self.backlog_len)
        self.backlog_len.zero_()

    def observe_accepted(self, hidden: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor) -> None:
        """Hand an observing drafter the target's hidden state after each slot's last accepted node."""
        if self.observes:
            last = path.gather(1, (path_len - 1)[:, None])
            self.drafter.observe_target(hidden.gather(1, last[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0])

    def observe_joined(self, hidden: Optional[torch.Tensor], slot: int) -> None:
        if self.observes and hidden is not None:
            self.drafter.observe_target(hidden, slot=slot)

    def park(self, idle: torch.Tensor, moved: bool, fed: bool) -> None:
        """Rewind idle slots: the drafter's when it ``moved`` this step, the backlog when it was ``fed``."""
        if moved:
            self.drafter.park(idle)
        if fed and self.lazy:
            self.backlog_len.masked_fill_(idle, 0)
