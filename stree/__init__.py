"""stree: speculative tree decoding for Mamba2 and hybrid Mamba2+attention language models.

The design card's folders (protocols/, verifier/, kernels/, drafter_service/, proto/) are this
package's subpackages ``stree.protocols``, ``stree.verifier``, ... once installed.
"""

from stree.protocols import (
    DraftBudget,
    DraftMode,
    Drafter,
    DrafterSession,
    HostDrafter,
    SamplingParams,
    TokenTree,
    TreeBatch,
    available_drafters,
    create_drafter,
    register_drafter,
)

__version__ = "0.1.0"


def __getattr__(name):
    # Heavier entry points load lazily so ``import stree`` stays cheap for drafter plugins.
    if name in ("load_model", "init_model"):
        from stree.verifier.model import checkpoint

        return getattr(checkpoint, name)
    if name == "generate":
        from stree.api import generate

        return generate
    if name == "GenerationResult":
        from stree.verifier.decode.loop import GenerationResult

        return GenerationResult
    if name == "Client":
        from stree.verifier.service.client import Client

        return Client
    raise AttributeError(f"module 'stree' has no attribute {name!r}")


__all__ = [
    "DraftBudget",
    "DraftMode",
    "Drafter",
    "DrafterSession",
    "HostDrafter",
    "SamplingParams",
    "TokenTree",
    "TreeBatch",
    "available_drafters",
    "create_drafter",
    "generate",
    "load_model",
    "register_drafter",
    "Client",
]
