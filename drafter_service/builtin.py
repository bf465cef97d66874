"""Registers the built-in drafters by name (imported lazily by the registry)."""

from stree.protocols.registry import register_drafter

from . import builtin_model_free
from .mamba_drafter import make_chain_drafter, make_mamba_drafter, make_static_tree_drafter

register_drafter("chain", make_chain_drafter, replace=True)
register_drafter("static-tree", make_static_tree_drafter, replace=True)
register_drafter("mamba", make_mamba_drafter, replace=True)
builtin_model_free.register()  # ngram, retrieval
