"""stree: speculative tree decoding for Mamba2 and hybrid Mamba2+attention language models.

The design card's folders (protocols/, verifier/, kernels/, drafter_service/, proto/) are this
package's subpackages ``stree.protocols``, ``stree.verifier``, ... once installed.
"""

import os as _os

# Run from a source checkout (``python -m pytest`` puts the repo root first on sys.path, so this
# folder shadows the installed package): let ``stree.<folder>`` find the top-level folders too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "protocols")) and _root not in __path__:
    __path__.append(_root)

from stree.protocols import (  # noqa: E402
    DraftBudget,
    DraftMode,
    Drafter,
    DrafterSession,
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
        from stree.verifier import checkpoint

        return getattr(checkpoint, name)
    if name in ("generate", "GenerationResult"):
        from stree.verifier import generate as _gen

        return getattr(_gen, name)
    if name == "Client":
        from stree.verifier.client import Client

        return Client
    raise AttributeError(f"module 'stree' has no attribute {name!r}")


__all__ = [
    "DraftBudget",
    "DraftMode",
    "Drafter",
    "DrafterSession",
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
