"""Shared types: token trees, sampling parameters, the drafter plugin interface and its registry."""

from stree.protocols.drafter import DEFAULT_BUDGET, ContextSession, DraftBudget, Drafter, DrafterSession, HostDrafter
from stree.protocols.registry import available_drafters, create_drafter, register_drafter
from stree.protocols.sampling import RowSampling, SamplingParams, sample_inverse_cdf, warp_logits, warp_logits_rows
from stree.protocols.token_tree import MAX_TREE_NODES, DraftMode, TokenTree, TreeBatch

__all__ = [
    "DEFAULT_BUDGET",
    "ContextSession",
    "DraftBudget",
    "DraftMode",
    "Drafter",
    "DrafterSession",
    "HostDrafter",
    "MAX_TREE_NODES",
    "RowSampling",
    "SamplingParams",
    "TokenTree",
    "TreeBatch",
    "available_drafters",
    "create_drafter",
    "register_drafter",
    "sample_inverse_cdf",
    "warp_logits",
    "warp_logits_rows",
]
