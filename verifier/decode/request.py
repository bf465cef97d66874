"""One generation in the engine: its prompt, limits and sampling, what it has emitted, and when it stops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from stree.protocols.drafter import DrafterSession
from stree.protocols.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")


def take_until_stop(tokens: Sequence[int], room: int, stop_token_ids) -> tuple[list[int], bool]:
    """The first ``room`` of ``tokens``, cut after the first stop token; and whether a stop token ended it."""
    out = []
    for tok in tokens[:room]:
        out.append(tok)
        if tok in stop_token_ids:
            return out, True
    return out, False


@dataclass
class Request:
    """A generation the engine runs: ``finish_reason`` is None while it runs, then one of ``FINISH_REASONS``
    (``error``: the engine could not run it; ``error_message`` says why)."""

    prompt_ids: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset = frozenset()
    request_id: object = None
    drafter_session: Optional[DrafterSession] = None  # host drafters only
    on_tokens: Optional[Callable[["Request", list[int]], None]] = None
    output: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error_message: Optional[str] = None
    steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draft_steps: int = 0  # steps that drafted for it (its own acceptance: verifier/decode/drain.py)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafter_fallbacks: int = 0
    host_drafted: int = 0  # nodes below the root in this step's host tree
    root_token: int = -1  # the last chosen token, not yet fed (host drafters' tree roots)
    prefill_s: float = 0.0
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None
    finished_s: Optional[float] = None
    admitted: bool = False  # took a slot (the engine closes its drafter session on leaving)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Ask the engine to drop this request at the next step boundary (its slot is freed)."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def fail(self, message: str) -> None:
        """End this request with ``finish_reason`` ``error`` (the engine drops it at the next step boundary)."""
        if self.finish_reason is None:
            self.finish_reason, self.error_message = "error", message
            self.finished_s = time.perf_counter()

    def emit(self, tokens: list[int]) -> list[int]:
        """Append up to the limit or through a stop token; returns what was appended."""
        out, stopped = take_until_stop(tokens, self.max_new_tokens - len(self.output), self.stop_token_ids)
        if stopped:
            self.finish_reason = "stop"
        self.output.extend(out)
        if tokens:
            self.root_token = tokens[-1]
        if self.finish_reason is None and len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"
        if out and self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        if self.done:
            self.finished_s = time.perf_counter()
        return out

    def record_step(self, new: list[int], drafted: int) -> None:
        """Count one step that emitted ``new`` (its accepted draft tokens, then the bonus) after ``drafted`` nodes."""
        self.steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_draft_tokens += len(new) - 1
        self.draft_steps += drafted > 0
        for pos in range(len(new) - 1):
            if pos == len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[pos] += 1

    @property
    def context(self) -> list[int]:
        """Every token before the root: the prompt and the output but their last token."""
        return (self.prompt_ids + self.output)[:-1]

    @property
    def stats(self) -> dict:
        end = self.finished_s or time.perf_counter()
        elapsed = end - self.submitted_s
        n = len(self.output)
        return {
            "steps": self.steps,
            "new_tokens": n,
            "mean_accepted_length": n / self.steps if self.steps else 0.0,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "prefill_s": self.prefill_s,
            "time_to_first_token_s": (self.first_token_s - self.submitted_s) if self.first_token_s else None,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "drafter_fallbacks": self.drafter_fallbacks,
            "finish_reason": self.finish_reason,
            "error": self.error_message,
        }
