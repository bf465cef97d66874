"""The built-in drafters (mamba, chain, static-tree, ngram, retrieval, fusion), registered by name.

The registry finds this module through the stree.drafters entry points, so the protocols
layer never imports a drafter.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from stree.protocols import Drafter, create_drafter
from stree.drafter_service.drafters.fusion.fusion import FusionDrafter, Scorer
from stree.drafter_service.drafters.fusion.scorer import DraftModelScorer
from stree.drafter_service.drafters.mamba.drafter import make_chain_drafter, make_mamba_drafter, make_static_tree_drafter
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.drafters.retrieval.drafter import RetrievalDrafter


FusionMember = Union[str, Drafter, tuple]


def make_fusion_drafter(drafters: Sequence[FusionMember], scorer: Optional[Scorer] = None,
                        draft_model=None) -> FusionDrafter:
    """A ``FusionDrafter`` over drafters given as objects, names, or ``(name, options)`` pairs.

    With a ``draft_model`` and no ``scorer``, merged branches are ranked by the draft model (RASD).
    """
    if scorer is None and draft_model is not None:
        scorer = DraftModelScorer(draft_model)
    built = []
    for spec in drafters:
        if isinstance(spec, str):
            built.append(create_drafter(spec))
        elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
            built.append(create_drafter(spec[0], **spec[1]))
        else:
            built.append(spec)
    return FusionDrafter(built, scorer=scorer)


make_ngram_drafter = NgramDrafter
make_retrieval_drafter = RetrievalDrafter

__all__ = ["make_chain_drafter", "make_fusion_drafter", "make_mamba_drafter", "make_ngram_drafter",
           "make_retrieval_drafter", "make_static_tree_drafter"]
