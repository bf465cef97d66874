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


def conv_scan_inputs(gen, parents, heads, headdim, groups, d_state, width, bias, dt_limit):
    """Random ``tree_conv_scan`` inputs on the tree batch ``parents``; xBC and dt_raw are column slices of one
    wider tensor, as in_proj gives them."""
    b, n = parents.shape
    c = heads * headdim + 2 * groups * d_state
    zxbcdt = torch.randn(b, n, 3 + c + heads, generator=gen)
    return dict(
        xBC=zxbcdt[..., 3:3 + c], conv_state=torch.randn(b, c, width - 1, generator=gen),
        conv_w=torch.randn(c, width, generator=gen) * 0.6,
        conv_b=torch.randn(c, generator=gen) if bias else None, parents=parents,
        dt_raw=zxbcdt[..., 3 + c:] * 2, dt_bias=torch.randn(heads, generator=gen), dt_limit=dt_limit,
        activation="silu", A=-torch.rand(heads, generator=gen) * 2 - 0.1, D=torch.randn(heads, generator=gen),
        ngroups=groups, headdim=headdim, ssm_state=torch.randn(b, heads, headdim, d_state, generator=gen),
    )


from stree.kernels.compare import rel_err  # noqa: E402,F401  (re-exported for the kernel tests)
