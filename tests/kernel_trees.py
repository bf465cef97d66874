"""Random token-tree shapes for the kernel tests: chains, stars, deep, bushy, binary, padded batches."""

from __future__ import annotations

import torch

from stree.protocols.token_tree import DraftMode, TokenTree, TreeBatch

KINDS = ("chain", "star", "deep", "bushy", "binary")


def on_each_backend(run) -> dict:
    """``{"torch": run(), "triton": run()}``, each with that kernel backend forced (restored afterwards)."""
    from stree.kernels import backend

    out = {}
    try:
        for which in ("torch", "triton"):
            backend.use(which)
            out[which] = run()
    finally:
        backend.use(None)
    return out


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


def verify_case(seed: int, mode: DraftMode, vocab: int, follow: float = 0.6, dtype=torch.float32):
    """``sampled_verify``'s arguments: a padded batch of random trees (tokens often the argmax after their parent, so walks go deep), logits,
    draft laws with zeros, uniforms, temperatures with some greedy rows."""
    gen = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 6, (1,), generator=gen))
    sizes = [int(torch.randint(1, 14, (1,), generator=gen)) for _ in range(b)]
    specs = [(KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))], n) for n in sizes]
    parents = padded_batch(specs, gen)
    n = parents.shape[1]
    valid = torch.arange(n)[None, :] < torch.tensor(sizes)[:, None]
    logits = (torch.randn(b, n, vocab, generator=gen) * 2).to(dtype)
    best = logits.argmax(-1)
    follow = torch.rand(b, n, generator=gen) < follow
    tokens = torch.where(follow, best.gather(1, parents.clamp_min(0)), torch.randint(0, vocab, (b, n), generator=gen))
    q = torch.rand(b, n, vocab, generator=gen) ** 3 * (torch.rand(b, n, vocab, generator=gen) > 0.25)
    q[torch.rand(b, n, generator=gen) < 0.1] = 0.0  # some all-zero draft rows
    q = None if mode is DraftMode.DETERMINISTIC else q
    temperature = 0.4 + 1.2 * torch.rand(b, generator=gen)
    temperature[torch.rand(b, generator=gen) < 0.25] = 0.0
    u, bu = torch.rand(b, n, generator=gen), torch.rand(b, n, generator=gen)
    depth = int(torch.randint(0, 6, (1,), generator=gen))
    width = int(torch.randint(1, 5, (1,), generator=gen))
    return (tokens, parents, valid, logits, temperature, None, None, mode, q, u, bu, depth, width)


from stree.kernels.compare import rel_err  # noqa: E402,F401  (re-exported for the kernel tests)
