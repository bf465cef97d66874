"""TokenTree: a tree of candidate tokens in topological order, plus its padded batch form.

Node 0 is the root: the last token already chosen but not yet fed to the target. Every other
node's parent comes earlier (``parent[i] < i``), so one left-to-right pass computes depths,
cumulative sums and ancestor sets. A tree may carry the draft distribution at each node and the
way its children were drawn, which lossless sampling needs (see ``DraftMode``).
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
import reprlib
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Iterable, Optional

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


_I64_MAX = 2**63 - 1
_INT_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)
_PROB_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_NOT_A_SEQUENCE = (str, bytes, bytearray, memoryview, Mapping, AbstractSet)
_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxtuple = 40, 40, 6, 6


def _kind(value) -> str:
    """A short description of ``value``'s type for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D numpy array of dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _scalar_int(value, where: str) -> int:
    """One integer id as a Python int; ``where`` names it (``"TokenTree: tokens[3]"``).

    Accepts ints, numpy integer scalars and 0-d integer tensors/arrays. Rejects bools and every
    float, integral ones like ``2.0`` included (``ValueError``), and other objects (``TypeError``).
    """
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where} is the bool {value}: ids must be integers, not bools")
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integer scalars
        return operator.index(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        if value.dtype in _INT_DTYPES and value.device.type != "meta":
            return int(value.item())
        raise ValueError(f"{where} is {_kind(value)}: ids must be integers")
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return _scalar_int(value[()], where)
    if isinstance(value, numbers.Number):
        raise ValueError(
            f"{where} is {_short.repr(value)}: ids must be integers (floats are rejected, even "
            "integral ones like 2.0)"
        )
    if isinstance(value, (torch.Tensor, np.ndarray, list, tuple, range)):
        raise ValueError(f"{where} is {_kind(value)}: ids must be 1-D (a flat run of integers)")
    raise TypeError(f"{where} is {_kind(value)}, not an integer id")


def _int_list(values, name: str, owner: str = "TokenTree") -> list[int]:
    """The ids in ``values`` (list, tuple, range, 1-D integer tensor or array) as Python ints.

    Raises ``TypeError`` for a wrong kind of object (dict, str, None, ...) and ``ValueError`` for
    bad contents (wrong dims, float/bool ids, more than ``MAX_TREE_NODES`` entries). Values are
    not range-checked here. Plain lists of ints take a fast path: this runs on every draft step.
    """
    tv = type(values)
    if tv is list or tv is tuple:
        if len(values) > MAX_TREE_NODES:
            raise ValueError(
                f"{owner}: {name} has {len(values)} entries, over the limit of {MAX_TREE_NODES} nodes"
            )
        for v in values:
            if type(v) is not int:
                break
        else:
            return values if tv is list else list(values)
        return [_scalar_int(v, f"{owner}: {name}[{i}]") for i, v in enumerate(values)]
    if isinstance(values, torch.Tensor):
        if values.layout is not torch.strided or values.is_nested:
            raise TypeError(f"{owner}: {name} must be a dense tensor, got layout {values.layout}")
        if values.dim() != 1:
            raise ValueError(f"{owner}: {name} must be 1-D, got shape {tuple(values.shape)}")
        if values.numel() == 0:
            return []
        if values.dtype not in _INT_DTYPES:
            raise ValueError(f"{owner}: {name} must be integers, got dtype {values.dtype}")
        if values.device.type == "meta":
            raise ValueError(f"{owner}: {name} is a meta tensor (it holds no values)")
        if values.numel() > MAX_TREE_NODES:
            raise ValueError(
                f"{owner}: {name} has {values.numel()} entries, over the limit of {MAX_TREE_NODES} nodes"
            )
        return values.tolist()
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{owner}: {name} must be 1-D, got shape {values.shape}")
        if values.size == 0:
            return []
        if values.size > MAX_TREE_NODES:
            raise ValueError(
                f"{owner}: {name} has {values.size} entries, over the limit of {MAX_TREE_NODES} nodes"
            )
        kind = values.dtype.kind
        if kind in "iu":
            return values.tolist()
        if kind == "O":
            return [_scalar_int(v, f"{owner}: {name}[{i}]") for i, v in enumerate(values.tolist())]
        if kind in "bfc":
            raise ValueError(f"{owner}: {name} must be integers, got dtype {values.dtype}")
        raise TypeError(f"{owner}: {name} must hold integer ids, got numpy dtype {values.dtype}")
    if isinstance(values, (numbers.Number, np.generic)):
        raise ValueError(
            f"{owner}: {name} must be 1-D (a sequence of ids), got the scalar {_short.repr(values)}"
        )
    if isinstance(values, Sequence) and not isinstance(values, _NOT_A_SEQUENCE):  # range, ...
        if len(values) > MAX_TREE_NODES:
            raise ValueError(
                f"{owner}: {name} has {len(values)} entries, over the limit of {MAX_TREE_NODES} nodes"
            )
        return _int_list(list(values), name, owner)
    raise TypeError(
        f"{owner}: {name} must be a list, tuple, 1-D tensor or 1-D array of integer ids, "
        f"got {_kind(values)}"
    )


def _long_tensor(values: list) -> torch.Tensor:
    """A new CPU int64 tensor from (nested) lists of in-range ints."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _as_mode(mode) -> "DraftMode":
    if type(mode) is DraftMode:
        return mode
    try:
        return DraftMode(mode)
    except (ValueError, TypeError):
        valid = ", ".join(repr(m.value) for m in DraftMode)
        raise ValueError(
            f"TokenTree: mode {_short.repr(mode)} is not a valid DraftMode (one of {valid})"
        ) from None


def _only_numbers(value, depth: int = 0) -> bool:
    """Whether nested lists/tuples hold only numbers (to tell a TypeError from a ValueError)."""
    if isinstance(value, (list, tuple)):
        return depth < 8 and all(_only_numbers(v, depth + 1) for v in value)
    return isinstance(value, (numbers.Number, np.generic, np.ndarray, torch.Tensor))


def _probs_tensor(probs) -> torch.Tensor:
    """``draft_probs`` as a tensor (not copied when it already is one; numpy arrays share memory)."""
    if isinstance(probs, torch.Tensor):
        return probs
    if isinstance(probs, np.ndarray):
        dt = probs.dtype
        if dt.kind != "f" or dt.itemsize > 8:
            err = ValueError if dt.kind in "biufc" else TypeError
            raise err(f"TokenTree: draft_probs must be floating point, got numpy dtype {dt}")
        if not dt.isnative or not probs.flags.writeable or any(s < 0 for s in probs.strides):
            probs = np.array(probs, dtype=dt.newbyteorder("="))
        return torch.from_numpy(probs)
    if isinstance(probs, (list, tuple)):
        try:
            return torch.as_tensor(probs)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            if not _only_numbers(probs):
                msg = f"TokenTree: draft_probs is not a nested list of numbers ({exc})"
                raise TypeError(msg) from None
            raise ValueError(f"TokenTree: draft_probs is not a [nodes, vocab] array ({exc})") from None
    raise TypeError(
        f"TokenTree: draft_probs must be a [nodes, vocab] float tensor, numpy array or nested "
        f"list, got {_kind(probs)}"
    )


def _check_probs(probs: torch.Tensor, n: int, max_token: int) -> None:
    """Shape ``[n, vocab > max_token]``, a float dtype, and every entry finite and >= 0."""
    if probs.layout is not torch.strided or probs.is_nested:
        raise TypeError(f"TokenTree: draft_probs must be a dense tensor, got layout {probs.layout}")
    if probs.dtype not in _PROB_DTYPES:
        raise ValueError(
            f"TokenTree: draft_probs must be float16/bfloat16/float32/float64, got dtype {probs.dtype}"
        )
    if probs.dim() != 2 or probs.shape[0] != n:
        raise ValueError(
            f"TokenTree: draft_probs must have shape [{n}, vocab], got {tuple(probs.shape)}"
        )
    if max_token >= probs.shape[1]:
        raise ValueError(
            f"TokenTree: token {max_token} is outside draft_probs' vocabulary of {probs.shape[1]}"
        )
    if probs.device.type == "meta":
        raise ValueError("TokenTree: draft_probs is a meta tensor (it holds no values)")
    # One pass over the data (NaN propagates through aminmax) and, on an accelerator, one sync.
    lo_hi = torch.aminmax(probs.detach())
    if probs.device.type == "cpu":
        lo, hi = float(lo_hi[0]), float(lo_hi[1])
    else:
        lo, hi = torch.stack(lo_hi).tolist()
    if math.isnan(lo) or math.isnan(hi):
        raise ValueError("TokenTree: draft_probs has NaN entries")
    if hi == math.inf or lo == -math.inf:
        raise ValueError("TokenTree: draft_probs has infinite entries")
    if lo < 0:
        raise ValueError(f"TokenTree: draft_probs has negative entries (min {lo})")


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool from ``[B, N]`` parents: ``mask[b, i, j]`` iff j is i or an ancestor of i.

    The one ancestor mask (the tree attention mask) of host trees, the model's tree pass and the
    device verifier. Pointer doubling: after step k each row holds its 2^k nearest ancestors, so
    ceil(log2 N) gathers cover any depth, on any device, with no host sync (CUDA-graph safe).
    """
    b, n = parents.shape
    jump = parents.clamp_min(0)  # the root points to itself
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n)
    mask = eye | torch.zeros_like(eye).scatter(2, jump.unsqueeze(-1), True)
    for _ in range(math.ceil(math.log2(max(n - 1, 1)))):
        mask = mask | mask.gather(1, jump.unsqueeze(-1).expand(b, n, n))
        jump = jump.gather(1, jump)
    return mask


@dataclass(frozen=True, eq=False)
class TokenTree:
    """Tokens plus parent indices of a speculation tree (``parents[0] == -1``, ``parents[i] < i``).

    ``draft_probs`` (optional, ``[N, vocab]``) is the draft distribution over the children of
    each node, after the same temperature/top-k/top-p warping the target gets; ``mode`` says how
    children were drawn. Construction validates the tree: ``ValueError`` naming the field for
    any defect (wrong dims, bool or float ids (even 2.0), ids that don't fit int64, bad parents,
    non-float or NaN/inf/negative ``draft_probs``), ``TypeError`` for a wrong kind of object
    (dict, str, None, ... where ids belong). ``tokens``/``parents`` are stored as fresh CPU int64
    tensors; ``draft_probs`` is kept as given (not copied: it may be large and on the GPU).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None
    mode: DraftMode = DraftMode.DETERMINISTIC
    _depth: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        # Everything is checked on plain Python lists: far cheaper than torch ops on tiny trees,
        # and this runs on every draft step.
        tlist = _int_list(self.tokens, "tokens")
        plist = _int_list(self.parents, "parents")
        n = len(tlist)
        if n == 0:
            raise ValueError("TokenTree: a tree needs at least the root node (got 0 nodes)")
        if len(plist) != n:
            raise ValueError(
                f"TokenTree: {n} tokens but {len(plist)} parents; they must match one to one"
            )
        if plist[0] != -1:
            raise ValueError(f"TokenTree: the root must have parent -1, got {_short.repr(plist[0])}")
        dlist = [0] * n
        for i in range(1, n):
            p = plist[i]
            if not 0 <= p < i:
                raise ValueError(
                    f"TokenTree: node {i} has parent {_short.repr(p)}; a parent must be an earlier "
                    f"node (0 <= parent < {i})"
                )
            dlist[i] = dlist[p] + 1
        lo, hi = min(tlist), max(tlist)
        if lo < 0:
            i = next(k for k, t in enumerate(tlist) if t < 0)
            raise ValueError(f"TokenTree: node {i} has negative token id {_short.repr(tlist[i])}")
        if hi > _I64_MAX:
            i = next(k for k, t in enumerate(tlist) if t > _I64_MAX)
            raise ValueError(
                f"TokenTree: node {i} has token id {_short.repr(tlist[i])}, which does not fit int64"
            )
        mode = _as_mode(self.mode)
        probs = self.draft_probs
        if probs is not None:
            probs = _probs_tensor(probs)
            _check_probs(probs, n, hi)
        elif mode is not DraftMode.DETERMINISTIC and n > 1:
            raise ValueError(f"TokenTree: mode {mode.value!r} needs draft_probs")
        # Fresh tensors: a caller's buffer changed later can't change (or break) the tree.
        # draft_probs is kept as given (copying [N, vocab] every step would cost too much).
        # (numpy builds a tensor from a list ~3x faster than torch.tensor does.)
        object.__setattr__(self, "tokens", _long_tensor(tlist))
        object.__setattr__(self, "parents", _long_tensor(plist))
        object.__setattr__(self, "draft_probs", probs)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "_depth", _long_tensor(dlist))

    # ----- construction -------------------------------------------------------------------
    @classmethod
    def from_parents(cls, tokens, parents, draft_probs=None, mode=DraftMode.DETERMINISTIC):
        """Build from flat lists/tensors of tokens and parent indices."""
        return cls(tokens=tokens, parents=parents, draft_probs=draft_probs, mode=mode)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "TokenTree":
        """A single path: root followed by ``tokens[1:]``."""
        toks = _int_list(tokens, "tokens")
        n = len(toks)
        return cls(tokens=toks, parents=[-1] + list(range(n - 1)) if n else [])

    @classmethod
    def from_sequences(cls, root: int, sequences: Iterable[Sequence[int]]) -> "TokenTree":
        """Prefix-merge token sequences hanging below ``root`` into one tree (order kept).

        Each sequence is a list/tuple/1-D tensor or array of int token ids; bools and floats
        (even integral ones like ``2.0``) are rejected with ``ValueError``.
        """
        root = _scalar_int(root, "TokenTree.from_sequences: root")
        if isinstance(sequences, (_NOT_A_SEQUENCE, numbers.Number, np.generic)) or (
            isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim != 2
        ):
            raise TypeError(
                "TokenTree.from_sequences: sequences must be an iterable of token-id sequences "
                f"(a list of lists, a 2-D tensor or array), got {_kind(sequences)}"
            )
        try:
            it = iter(sequences)
        except TypeError:
            raise TypeError(
                "TokenTree.from_sequences: sequences must be an iterable of token-id sequences, "
                f"got {_kind(sequences)}"
            ) from None
        tokens, parents = [root], [-1]
        children: dict[tuple[int, int], int] = {}
        for k, seq in enumerate(it):
            node = 0
            for tok in _int_list(seq, f"sequences[{k}]", "TokenTree.from_sequences"):
                key = (node, tok)
                child = children.get(key)
                if child is None:
                    child = children[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = child
            if len(tokens) > MAX_TREE_NODES:
                raise ValueError(
                    f"TokenTree: {len(tokens)} nodes is over the limit of {MAX_TREE_NODES} "
                    f"(after sequences[{k}])"
                )
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
        return ancestor_mask(self.parents[None])[0]

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
    is_chain: bool = False  # every row is the chain parents[i] = i - 1 (kernels then skip the parent walk)

    @classmethod
    def from_trees(cls, trees: Sequence[TokenTree], pad_to: Optional[int] = None) -> "TreeBatch":
        if isinstance(trees, TokenTree):
            raise TypeError("TreeBatch: trees must be a sequence of TokenTrees, got a single TokenTree")
        if not isinstance(trees, Sequence) or isinstance(trees, _NOT_A_SEQUENCE):
            raise TypeError(f"TreeBatch: trees must be a sequence of TokenTrees, got {_kind(trees)}")
        if len(trees) == 0:
            raise ValueError("TreeBatch: need at least one tree")
        for k, t in enumerate(trees):
            if not isinstance(t, TokenTree):
                raise TypeError(f"TreeBatch: trees[{k}] is {_kind(t)}, not a TokenTree")
        sizes = [t.num_nodes for t in trees]
        n = max(sizes)
        if pad_to is not None:
            pad_to = _scalar_int(pad_to, "TreeBatch: pad_to")
            if pad_to < n:
                raise ValueError(f"TreeBatch: pad_to={pad_to} is smaller than a tree of {n} nodes")
            if pad_to > MAX_TREE_NODES:
                raise ValueError(
                    f"TreeBatch: pad_to={pad_to} is over the limit of {MAX_TREE_NODES} nodes"
                )
            n = pad_to
        # Rows as plain lists, one tensor each: cheaper than per-tree slice assignment.
        tok_rows, par_rows, dep_rows = [], [], []
        for t, m in zip(trees, sizes):
            pad = n - m
            tok_rows.append(t.tokens.tolist() + [0] * pad)
            par_rows.append(t.parents.tolist() + [0] * pad)
            dep_rows.append(t.depth.tolist() + [1] * pad)
        return cls(
            tokens=_long_tensor(tok_rows),
            parents=_long_tensor(par_rows),
            depth=_long_tensor(dep_rows),
            num_nodes=_long_tensor(sizes),
        )

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[B, N, N]`` bool: node j is i or an ancestor of i."""
        return ancestor_mask(self.parents.cpu())

    def to(self, device) -> "TreeBatch":
        return TreeBatch(
            tokens=self.tokens.to(device),
            parents=self.parents.to(device),
            depth=self.depth.to(device),
            num_nodes=self.num_nodes.to(device),
            is_chain=self.is_chain,
        )
