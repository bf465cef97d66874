"""TokenTree: a tree of candidate tokens in topological order, plus its padded batch form.

Node 0 is the root: the last token already chosen but not yet fed to the target. Every other
node's parent comes earlier (``parent[i] < i``), so one left-to-right pass computes depths,
cumulative sums and ancestor sets. A tree may carry the draft distribution at each node and the
way its children were drawn, which lossless sampling needs (see ``DraftMode``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

MAX_TREE_NODES = 1024
"""Hard limit on nodes in one tree (kernels are tuned for up to 256; see kernels/README)."""


class DraftMode(str, enum.Enum):
    """How the children of a node were drawn from the draft distribution.

    ``deterministic``: chosen without randomness (argmax, beam search, n-gram, retrieval): each
    child is verified as a point mass. ``iid``: each child is an independent draw from q.
    ``without_replacement``: children are successive draws from q with earlier picks removed
    (Gumbel-top-k). The verifier picks the matching rejection rule.
    """

    DETERMINISTIC = "deterministic"
    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"


def _as_long_1d(values, name: str) -> torch.Tensor:
    t = torch.as_tensor(values)
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        if t.numel() == 0:
            t = t.long()
        else:
            raise ValueError(f"TokenTree: {name} must be integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"TokenTree: {name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(torch.long).cpu()


def _ancestor_masks(parents: np.ndarray) -> np.ndarray:
    """``[B, N, N]`` bool from ``[B, N]`` parents (``parent[i] < i``): row i = row parent(i) plus i.

    numpy rows, one per node: far cheaper than torch indexing on every draft step.
    """
    b, n = parents.shape
    mask = np.zeros((b, n, n), dtype=bool)
    ar = np.arange(b)
    mask[:, 0, 0] = True
    for i in range(1, n):
        mask[:, i] = mask[ar, parents[:, i]]
        mask[:, i, i] = True
    return mask


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Tokens plus parent indices of a speculation tree (``parents[0] == -1``, ``parents[i] < i``).

    ``draft_probs`` (optional, ``[N, vocab]``) is the draft distribution over the children of
    each node, after the same temperature/top-k/top-p warping the target gets; ``mode`` says how
    children were drawn. Construction validates the tree and raises ``ValueError`` on any defect.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None
    mode: DraftMode = DraftMode.DETERMINISTIC
    _depth: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        tokens = _as_long_1d(self.tokens, "tokens")
        parents = _as_long_1d(self.parents, "parents")
        n = tokens.numel()
        if n == 0:
            raise ValueError("TokenTree: a tree needs at least the root node (got 0 nodes)")
        if n > MAX_TREE_NODES:
            raise ValueError(f"TokenTree: {n} nodes is over the limit of {MAX_TREE_NODES}")
        if parents.numel() != n:
            raise ValueError(
                f"TokenTree: {n} tokens but {parents.numel()} parents; they must match one to one"
            )
        plist, tlist = parents.tolist(), tokens.tolist()  # plain lists: this runs on every draft step
        if plist[0] != -1:
            raise ValueError(f"TokenTree: the root must have parent -1, got {plist[0]}")
        dlist = [0] * n
        for i in range(1, n):
            p = plist[i]
            if not 0 <= p < i:
                raise ValueError(
                    f"TokenTree: node {i} has parent {p}; a parent must be an earlier "
                    f"node (0 <= parent < {i})"
                )
            dlist[i] = dlist[p] + 1
        if min(tlist) < 0:
            i = next(k for k, t in enumerate(tlist) if t < 0)
            raise ValueError(f"TokenTree: node {i} has negative token id {tlist[i]}")
        mode = DraftMode(self.mode)
        probs = self.draft_probs
        if probs is not None:
            probs = torch.as_tensor(probs)
            if probs.dim() != 2 or probs.shape[0] != n:
                raise ValueError(
                    f"TokenTree: draft_probs must have shape [{n}, vocab], got {tuple(probs.shape)}"
                )
            if int(tokens.max()) >= probs.shape[1]:
                raise ValueError(
                    f"TokenTree: token {int(tokens.max())} is outside draft_probs' vocabulary "
                    f"of {probs.shape[1]}"
                )
        elif mode is not DraftMode.DETERMINISTIC and n > 1:
            raise ValueError(f"TokenTree: mode {mode.value!r} needs draft_probs")
        depth = torch.tensor(dlist, dtype=torch.long)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "draft_probs", probs)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "_depth", depth)

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_parents(cls, tokens, parents, draft_probs=None, mode=DraftMode.DETERMINISTIC):
        """Build from flat lists/tensors of tokens and parent indices."""
        return cls(tokens=tokens, parents=parents, draft_probs=draft_probs, mode=mode)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "TokenTree":
        """A single path: root followed by ``tokens[1:]``."""
        n = len(tokens)
        return cls(tokens=list(tokens), parents=[-1] + list(range(n - 1)))

    @classmethod
    def from_sequences(cls, root: int, sequences: Iterable[Sequence[int]]) -> "TokenTree":
        """Prefix-merge token sequences hanging below ``root`` into one tree (order kept)."""
        tokens, parents = [int(root)], [-1]
        children: dict[tuple[int, int], int] = {}
        for seq in sequences:
            node = 0
            for tok in seq:
                key = (node, int(tok))
                if key not in children:
                    children[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                node = children[key]
        return cls(tokens=tokens, parents=parents)

    # ----- derived structure ------------------------------------------------------------
    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def depth(self) -> torch.Tensor:
        """``depth[i]``: number of ancestors of node i (root has depth 0)."""
        return self._depth

    @property
    def max_depth(self) -> int:
        return int(self._depth.max())

    def ancestor_mask(self) -> torch.Tensor:
        """``L[i, j] = True`` iff j is i or an ancestor of i (the tree attention mask)."""
        return torch.from_numpy(_ancestor_masks(self.parents.numpy()[None])[0])

    def position_ids(self, offset: int = 0) -> torch.Tensor:
        """Position of each node when the committed sequence has ``offset`` tokens."""
        return self._depth + offset

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"TokenTree: node {node} is out of range (0..{self.num_nodes - 1})")
        out = []
        plist = self.parents.tolist()
        while node != -1:
            out.append(node)
            node = plist[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        toks = self.tokens.tolist()
        return [toks[i] for i in self.path(node)]

    def children(self) -> list[list[int]]:
        """Children of every node, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids

    def leaves(self) -> list[int]:
        return [i for i, k in enumerate(self.children()) if not k]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a token is outside ``[0, vocab_size)``."""
        if int(self.tokens.max()) >= vocab_size:
            bad = self.tokens >= vocab_size
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"TokenTree: node {i} has token {int(self.tokens[i])}, outside the vocabulary "
                f"of {vocab_size}"
            )

    def to_sequences(self) -> list[list[int]]:
        """Token sequences of every root-to-leaf path, root excluded."""
        return [self.path_tokens(leaf)[1:] for leaf in self.leaves()]

    def __repr__(self) -> str:
        return (
            f"TokenTree(nodes={self.num_nodes}, depth={self.max_depth}, mode={self.mode.value}, "
            f"tokens={self.tokens.tolist()}, parents={self.parents.tolist()})"
        )


@dataclass(frozen=True)
class TreeBatch:
    """Trees of different sizes padded to one ``[batch, N]`` layout for a batched tree pass.

    Padding nodes hang off the root (parent 0, token 0) so ``parent[i] < i`` holds everywhere;
    no real node descends from them, so they never change a real node's output.
    """

    tokens: torch.Tensor  # [B, N] long
    parents: torch.Tensor  # [B, N] long, parents[:, 0] == -1
    depth: torch.Tensor  # [B, N] long
    num_nodes: torch.Tensor  # [B] long

    @classmethod
    def from_trees(cls, trees: Sequence[TokenTree], pad_to: Optional[int] = None) -> "TreeBatch":
        if not trees:
            raise ValueError("TreeBatch: need at least one tree")
        n = max(t.num_nodes for t in trees)
        if pad_to is not None:
            if pad_to < n:
                raise ValueError(f"TreeBatch: pad_to={pad_to} is smaller than a tree of {n} nodes")
            n = pad_to
        b = len(trees)
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.zeros(b, n, dtype=torch.long)
        depth = torch.ones(b, n, dtype=torch.long)
        for k, t in enumerate(trees):
            m = t.num_nodes
            tokens[k, :m] = t.tokens
            parents[k, :m] = t.parents
            depth[k, :m] = t.depth
        parents[:, 0] = -1
        depth[:, 0] = 0
        num = torch.tensor([t.num_nodes for t in trees], dtype=torch.long)
        return cls(tokens=tokens, parents=parents, depth=depth, num_nodes=num)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[B, N, N]`` bool: node j is i or an ancestor of i."""
        return torch.from_numpy(_ancestor_masks(self.parents.cpu().numpy()))

    def to(self, device) -> "TreeBatch":
        return TreeBatch(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            depth=self.depth.to(device),
            num_nodes=self.num_nodes.to(device),
        )
