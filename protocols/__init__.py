"""Shared types: token trees, sampling parameters, the drafter plugin interface and its registry."""

from .drafter import ContextSession, DraftBudget, Drafter, DrafterSession
from .registry import available_drafters, create_drafter, register_drafter
from .sampling import SamplingParams, warp_logits
from .token_tree import MAX_TREE_NODES, DraftMode, TokenTree, TreeBatch

__all__ = [
    "ContextSession",
    "DraftBudget",
    "DraftMode",
    "Drafter",
    "DrafterSession",
    "MAX_TREE_NODES",
    "SamplingParams",
    "TokenTree",
    "TreeBatch",
    "available_drafters",
    "create_drafter",
    "register_drafter",
    "warp_logits",
]
