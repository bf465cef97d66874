"""The one check of a drafted tree before the verifier scores it.

``tree_problem`` says why a drafter's output can't be verified as is (wrong type, wrong root,
tokens outside the target's vocabulary, draft distribution over another vocabulary, over the
draft budget), or returns None; ``check_tree`` raises ``ValueError`` with that reason. The
structural checks (parents, token ids, draft_probs values) already ran when the ``TokenTree``
was built; this adds what depends on the generation: its root token, vocabulary and budget.

Imports only ``protocols.token_tree`` at module level; ``DraftBudget`` comes from
``protocols.drafter``, which imports this module, so it is imported lazily here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .token_tree import TokenTree, _scalar_int

if TYPE_CHECKING:
    from .drafter import DraftBudget

__all__ = ["budget_problem", "check_tree", "tree_problem"]


def budget_problem(tree: TokenTree, budget: "DraftBudget") -> Optional[str]:
    """Why ``tree`` breaks ``budget`` (nodes, depth below the root, children per node), or None."""
    if tree.num_nodes > budget.max_nodes:
        return f"{tree.num_nodes} nodes > max_nodes {budget.max_nodes}"
    if tree.max_depth > budget.max_depth:
        return f"depth {tree.max_depth} > max_depth {budget.max_depth}"
    if tree.num_nodes > 1:
        counts = [0] * tree.num_nodes
        for p in tree.parents.tolist()[1:]:
            counts[p] += 1
        width = max(counts)
        if width > budget.max_width:
            return f"a node has {width} children > max_width {budget.max_width}"
    return None


def tree_problem(tree, root: int, budget: "DraftBudget", vocab_size: int) -> Optional[str]:
    """Why a drafted tree can't be verified as is, or None when it can.

    ``root`` is the last committed token (the tree's root token must equal it), ``vocab_size``
    the target's vocabulary. Raises ``TypeError``/``ValueError`` only for bad arguments of the
    check itself (a non-int root or vocab_size, vocab_size < 1, budget not a ``DraftBudget``).
    """
    from .drafter import DraftBudget  # lazy: drafter.py imports this module

    root = _scalar_int(root, "tree check: root")
    vocab_size = _scalar_int(vocab_size, "tree check: vocab_size")
    if vocab_size < 1:
        raise ValueError(f"tree check: vocab_size must be >= 1, got {vocab_size}")
    if not isinstance(budget, DraftBudget):
        raise TypeError(f"tree check: budget must be a DraftBudget, got {type(budget).__name__}")
    if not isinstance(tree, TokenTree):
        return f"drafter returned {type(tree).__name__}, not a TokenTree"
    tokens = tree.tokens.tolist()
    if tokens[0] != root:
        return f"tree root token {tokens[0]} is not the current last token {root}"
    top = max(tokens)
    if top >= vocab_size:
        return f"tree token {top} is outside the vocabulary of {vocab_size}"
    if min(tokens) < 0:  # only if the tree's tensor was changed in place after it was built
        return f"tree token {min(tokens)} is negative"
    probs = tree.draft_probs
    if probs is not None and probs.shape[-1] != vocab_size:
        return f"draft_probs cover {probs.shape[-1]} tokens, the target has {vocab_size}"
    if probs is not None and not bool((torch.isfinite(probs) & (probs >= 0)).all()):  # changed in place after build
        return "draft_probs hold NaN, infinite or negative entries"
    return budget_problem(tree, budget)


def check_tree(tree, root: int, budget: "DraftBudget", vocab_size: int) -> TokenTree:
    """``tree`` when it can be verified as is; ``ValueError`` saying why not otherwise."""
    why = tree_problem(tree, root, budget, vocab_size)
    if why is not None:
        raise ValueError(why)
    return tree
