"""One drafter replica: the body of a Ray actor that hosts many sessions of one drafter plugin.

Each call answers with a status tuple instead of raising, so the gRPC service can tell a bad
request ("invalid") from a plugin that broke ("failed") or a session this process no longer has
("lost": the actor was restarted and lost its memory); the service re-opens lost sessions from
the context it tracks.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from typing import Callable, Optional, Sequence

from stree.protocols.drafter import DraftBudget
from stree.protocols.sampling import SamplingParams

from .wire import tree_to_payload

log = logging.getLogger(__name__)

OK, INVALID, FAILED, LOST = "ok", "invalid", "failed", "lost"


def filter_options(factory: Callable, options: dict) -> dict:
    """The options ``factory`` accepts (all of them when it takes ``**kwargs``)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return dict(options)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in sig.parameters}


def _device_for_this_process() -> str:
    import torch

    try:
        import ray

        if ray.is_initialized() and ray.get_gpu_ids() and torch.cuda.is_available():
            return "cuda"
    except Exception as exc:  # no Ray context (plain process): CPU
        log.debug("no Ray GPU assignment: %r", exc)
    return "cpu"


class DrafterReplica:
    """Sessions of one drafter, keyed by session id; ``draft`` applies pending commits then drafts."""

    def __init__(self, name: str, factory: Callable, options: Optional[dict] = None, replica_id: str = "0"):
        self.name = name
        self.replica_id = replica_id
        self.device = _device_for_this_process()
        opts = dict(options or {})
        draft_model = opts.get("draft_model")
        if isinstance(draft_model, (str, os.PathLike)):
            from stree.verifier.checkpoint import load_model

            opts["draft_model"] = load_model(draft_model, device=self.device)
        self.drafter = factory(**filter_options(factory, opts))
        # session id -> [session, context length]
        self.sessions: dict[str, list] = {}

    def info(self) -> dict:
        """Where this replica runs (also a readiness probe)."""
        return {
            "name": self.name,
            "replica": self.replica_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": self.device,
            "sessions": len(self.sessions),
        }

    def open(self, session_id: str, prompt_ids: Sequence[int], sampling: dict) -> tuple:
        """Start (or restart) session ``session_id`` from ``prompt_ids``."""
        self._drop(session_id)
        try:
            params = SamplingParams(**sampling)
            if len(prompt_ids) == 0:
                raise ValueError("the prompt must contain at least one token")
        except (TypeError, ValueError) as exc:
            return (INVALID, str(exc))
        try:
            session = self.drafter.open(list(prompt_ids), params)
        except ValueError as exc:
            return (INVALID, f"drafter {self.name!r} refused the session: {exc}")
        except Exception as exc:
            return (FAILED, f"drafter {self.name!r} failed to open a session: {exc!r}")
        self.sessions[session_id] = [session, len(prompt_ids)]
        return (OK, self.replica_id)

    def draft(self, session_id: str, commit_tokens: Sequence[int], context_length: int, budget: tuple) -> tuple:
        """Commit ``commit_tokens``, then draft for ``context_length``: ``(OK, payload, seconds)`` or ``(status, message)``."""
        entry = self.sessions.get(session_id)
        if entry is None:
            return (LOST, f"replica {self.replica_id} has no session {session_id}")
        session, length = entry
        if length + len(commit_tokens) != context_length:
            return (
                INVALID,
                f"draft is for context length {context_length} but the session has "
                f"{length} + {len(commit_tokens)} committed tokens",
            )
        t0 = time.perf_counter()
        try:
            if commit_tokens:
                session.commit(list(commit_tokens))
            entry[1] = context_length
            tree = session.draft(DraftBudget(*budget))
            payload = tree_to_payload(tree)
        except Exception as exc:  # a broken plugin: drop the session, the service re-opens it
            self._drop(session_id)
            return (FAILED, f"drafter {self.name!r} failed: {exc!r}")
        return (OK, payload, time.perf_counter() - t0)

    def close(self, session_id: str) -> None:
        self._drop(session_id)

    def num_sessions(self) -> int:
        return len(self.sessions)

    def _drop(self, session_id: str) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is not None:
            try:
                entry[0].close()
            except Exception as exc:  # closing is best effort; the session is gone either way
                log.warning("closing session %s of drafter %r failed: %r", session_id, self.name, exc)
