"""``DrafterSession``: a ``ContextSession`` that keeps the drafter which opened it.

The n-gram and retrieval drafters hold their settings (and the retrieval datastore) on the drafter
and only the per-generation state on the session, which reads the settings back through ``drafter``.
Such a session forks (``ForkableSession``) by copying its context; the drafter stays shared.
"""

from __future__ import annotations

import copy
from typing import Sequence

from stree.protocols import ContextSession, SamplingParams


class DrafterSession(ContextSession):
    """The token context as a list, plus ``drafter``: the drafter whose ``open`` started it."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, drafter):
        super().__init__(prompt_ids, params)
        self.drafter = drafter

    def fork(self) -> "DrafterSession":
        """A copy with its own context list, sharing the drafter; a subclass with more per-generation state copies
        that too."""
        other = copy.copy(self)
        other.context = list(self.context)
        return other
