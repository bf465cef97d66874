"""Registers the model-free drafters (``ngram``, ``retrieval``) and tree ``fusion`` with the registry."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from stree.protocols import Drafter, create_drafter, register_drafter

from .fusion import FusionDrafter, Scorer
from .ngram import NgramDrafter
from .retrieval import RetrievalDrafter

DrafterSpec = Union[str, Drafter, tuple]


def make_fusion_drafter(drafters: Sequence[DrafterSpec], scorer: Optional[Scorer] = None) -> FusionDrafter:
    """A ``FusionDrafter`` over drafters given as objects, names, or ``(name, options)`` pairs."""
    built = []
    for spec in drafters:
        if isinstance(spec, str):
            built.append(create_drafter(spec))
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
            built.append(create_drafter(spec[0], **spec[1]))
        else:
            built.append(spec)
    return FusionDrafter(built, scorer=scorer)


def register() -> None:
    """Add this module's drafters to the registry (idempotent)."""
    register_drafter("ngram", NgramDrafter)
    register_drafter("retrieval", RetrievalDrafter)
    register_drafter("fusion", make_fusion_drafter)
