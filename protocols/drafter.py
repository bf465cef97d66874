"""The drafter plugin interface: a Drafter opens per-generation sessions that draft token trees.

A session holds the drafter's own state for one generation (a draft model's SSM state, an
n-gram index of the context, ...). Its context is the prompt plus every token committed since;
``draft`` returns a tree whose root is the last context token. Drafters can only change speed:
the verifier checks every drafted token, so a wrong or empty draft costs time, never output.

A drafter that can also draft for many sequences at once as device code offers a ``DeviceDrafter``
(``protocols/device_drafter.py``) through ``device_drafter()``; the engine then drafts inside its step graph.
Host-only drafters return None there (``HostDrafter`` does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

from .sampling import SamplingParams
from .token_tree import MAX_TREE_NODES, TokenTree
from .validate import budget_problem

if TYPE_CHECKING:
    from .device_drafter import DeviceOffer


@dataclass(frozen=True)
class DraftBudget:
    """Upper bounds on a drafted tree: nodes (root included), depth below the root, children per node."""

    max_nodes: int = 16
    max_depth: int = 8
    max_width: int = 4

    def __post_init__(self):
        if not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in 1..{MAX_TREE_NODES}, got {self.max_nodes}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")
        if self.max_width < 1:
            raise ValueError(f"max_width must be >= 1, got {self.max_width}")

    def violation(self, tree: TokenTree) -> str | None:
        """Why ``tree`` breaks this budget, or None when it fits (see ``protocols.validate``)."""
        return budget_problem(tree, self)

    def check(self, tree: TokenTree) -> None:
        why = self.violation(tree)
        if why is not None:
            raise ValueError(f"drafted tree is over budget: {why}")


DEFAULT_BUDGET = DraftBudget(max_nodes=64, max_depth=16, max_width=8)
"""The budget a generation drafts under unless it is given another."""


@runtime_checkable
class DrafterSession(Protocol):
    """One generation's drafting state."""

    def draft(self, budget: DraftBudget) -> TokenTree:
        """A tree rooted at the last context token, within ``budget``."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """Append tokens the verifier accepted (the accepted path below the root, then the bonus)."""
        ...

    def close(self) -> None:
        """Release the session's resources."""
        ...


@runtime_checkable
class ForkableSession(DrafterSession, Protocol):
    """A session that can copy itself. Drafting ahead (``drafter_service/lookahead.py``) commits a hypothetical
    outcome to a copy and drafts from it while the session itself stays where the verifier is; when the hypothesis
    comes true the copy takes the session's place, its state being what committing those tokens gives. Sessions
    without ``fork`` are served as before, without drafting ahead."""

    def fork(self) -> "ForkableSession":
        """An independent copy: committing to or drafting from either leaves the other as it was."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """A drafter plugin: a named factory of sessions, and optionally of device drafts."""

    name: str

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> DrafterSession:
        """Start a session whose context is ``prompt_ids`` (non-empty). ``params.seed`` seeds the session's own
        draws; callers give every session its own (``session_params``): drafts two requests drew alike would be
        one draw, not the independent draws from q that lossless sampled verification needs."""
        ...

    def device_drafter(self) -> Optional["DeviceOffer"]:
        """The device drafter and the tree shapes it offers, or None when this drafter drafts on the host only."""
        ...


class HostDrafter:
    """Base for drafters that draft on the host only (sessions per generation): ``device_drafter`` is None."""

    name = "host"

    def device_drafter(self) -> None:
        return None


def drafter_problem(drafter: object) -> Optional[str]:
    """Why ``drafter`` does not follow the ``Drafter`` protocol (the first missing part), or None."""
    for part in ("name", "open", "device_drafter"):
        if getattr(drafter, part, None) is None:
            return (f"{type(drafter).__name__} has no {part!r}: a drafter has a name, open(prompt_ids, params) and "
                    f"device_drafter() (subclass stree.HostDrafter for a host-only drafter)")
    return None


class ContextSession:
    """Base for sessions that keep the token context as a plain list (n-gram, retrieval, ...)."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams):
        if len(prompt_ids) == 0:
            raise ValueError("a drafter session needs a non-empty prompt")
        self.context: list[int] = [int(t) for t in prompt_ids]
        self.params = params

    def commit(self, tokens: Sequence[int]) -> None:
        self.context.extend(int(t) for t in tokens)

    def close(self) -> None:
        self.context = []

    def root_only(self) -> TokenTree:
        """The empty draft: just the root (the verifier then does one plain decoding step)."""
        return TokenTree.chain([self.context[-1]])


def session_params(params: SamplingParams) -> SamplingParams:
    """``params`` for a request's host drafter session: a seed of its own, drawn from the request's (a seeded
    request stays reproducible) or fresh, so its draws are neither another session's nor the verifier's."""
    return replace(params, seed=session_seeds(params.seed, 1)[0])


def session_seeds(seed: Optional[int], count: int) -> list[int]:
    """``count`` seeds for host drafter sessions, one per request: drawn from ``seed`` (a seeded run stays
    reproducible) or from the system's entropy (None), never one seed shared by requests."""
    rng = random.Random(seed) if seed is not None else random.SystemRandom()
    return [rng.getrandbits(62) for _ in range(count)]
