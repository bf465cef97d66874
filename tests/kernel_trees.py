"""Random token-tree shapes for the kernel tests: chains, stars, deep, bushy, binary, padded batches."""

from __future__ import annotations

import torch

from stree.protocols.token_tree import TokenTree, TreeBatch

KINDS = ("chain", "star", "deep", "bushy", "binary")


def tree_parents(kind: str, n: int, gen: torch.Generator) -> list[int]:
    """Parent list (``parents[0] == -1``, ``parents[i] < i``) of an ``n``-node tree of the given kind."""
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        elif kind == "deep":  # mostly a chain with a few short side branches
            parents.append(max(0, i - 1 - int(torch.randint(0, 2, (1,), generator=gen))))
        elif kind == "bushy":
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
        elif kind == "binary":
            parents.append((i - 1) // 2)
        else:
            raise ValueError(f"unknown tree kind {kind!r}")
    return parents


def padded_batch(specs, gen: torch.Generator) -> torch.Tensor:
    """``[B, N]`` parents of a padded tree batch built by ``TreeBatch`` from ``(kind, n)`` specs."""
    trees = [TokenTree.from_parents([0] * n, tree_parents(kind, n, gen)) for kind, n in specs]
    return TreeBatch.from_trees(trees).parents


from stree.kernels.compare import rel_err  # noqa: E402,F401  (re-exported for the kernel tests)
