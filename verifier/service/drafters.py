"""Where a server's drafters come from: built in this process by name, or a DrafterService over gRPC."""

from __future__ import annotations

import threading
from typing import Optional

from stree.protocols.drafter import DraftBudget, Drafter
from stree.protocols.registry import create_drafter, filter_options, get_drafter_factory
from stree.verifier.service.remote_drafter import RemoteDrafter

NO_DRAFTER = "none"


class EmbeddedDrafters:
    """Drafters built in this process by name (one instance per name, shared by sessions)."""

    def __init__(self, default: str, draft_model=None, options: Optional[dict] = None):
        self.default = default
        self.draft_model = draft_model
        self.options = dict(options or {})
        self._built: dict[str, Drafter] = {}
        self._lock = threading.Lock()
        if default != NO_DRAFTER:
            get_drafter_factory(default)  # fail at start-up on an unknown default

    def get(self, name: str) -> Optional[Drafter]:
        name = name or self.default
        if name == NO_DRAFTER:
            return None
        with self._lock:
            if name not in self._built:
                opts = dict(self.options)
                if self.draft_model is not None:
                    opts["draft_model"] = self.draft_model
                self._built[name] = create_drafter(name, **filter_options(get_drafter_factory(name), opts))
            return self._built[name]

    def describe(self) -> str:
        return f"in-process (default {self.default})"

    async def aclose(self) -> None:
        self._built.clear()


class RemoteDrafters:
    """Drafters of a DrafterService: ``grpc://HOST:PORT/NAME`` sets the default name."""

    def __init__(self, url: str, deadline_s: float, budget: DraftBudget, overlap: int = 0):
        self.remote = RemoteDrafter(url, deadline_s=deadline_s, budget=budget, overlap=overlap)
        self.default = self.remote.drafter

    def get(self, name: str) -> Optional[Drafter]:
        name = name or self.default
        if name == NO_DRAFTER:
            return None
        return self.remote if name == self.remote.drafter else self.remote.with_drafter(name)

    def describe(self) -> str:
        ahead = f", {self.remote.overlap} trees drafted ahead" if self.remote.overlap else ""
        return f"remote {self.remote.name} (deadline {1e3 * self.remote.deadline_s:.0f} ms{ahead})"

    async def aclose(self) -> None:
        await self.remote.aclose()
