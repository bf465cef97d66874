"""Conversions between the shared Python types and their ``stree.v1`` protobuf messages.

Both ends of the DrafterService (the Ray-backed service and the verifier's ``RemoteDrafter``) and
the GenerationService use these, so a tree or a sampling setting means the same on both sides.
Anything malformed coming off the wire raises ``ValueError`` saying what is wrong.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from stree.proto.stree.v1 import common_pb2, drafter_pb2
from stree.protocols.drafter import DraftBudget
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import DraftMode, TokenTree

_MODE_TO_PB = {
    DraftMode.DETERMINISTIC: drafter_pb2.DRAFT_MODE_DETERMINISTIC,
    DraftMode.IID: drafter_pb2.DRAFT_MODE_IID,
    DraftMode.WITHOUT_REPLACEMENT: drafter_pb2.DRAFT_MODE_WITHOUT_REPLACEMENT,
}
_MODE_FROM_PB = {v: k for k, v in _MODE_TO_PB.items()}


# ----- sampling parameters and budgets ---------------------------------------------------------
def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """``SamplingParams`` from the wire; an unset top_p means 1.0. Raises ``ValueError`` when invalid."""
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(top_p), seed=seed)


def budget_to_pb(budget: DraftBudget) -> common_pb2.DraftBudget:
    return common_pb2.DraftBudget(
        max_nodes=budget.max_nodes, max_depth=budget.max_depth, max_width=budget.max_width
    )


def budget_from_pb(msg: Optional[common_pb2.DraftBudget], default: DraftBudget) -> DraftBudget:
    """A budget whose zero (unset) fields take ``default``'s values. Raises ``ValueError`` when invalid."""
    if msg is None:
        return default
    return DraftBudget(
        max_nodes=msg.max_nodes or default.max_nodes,
        max_depth=msg.max_depth or default.max_depth,
        max_width=msg.max_width or default.max_width,
    )


def budget_tuple(budget: DraftBudget) -> tuple[int, int, int]:
    return (budget.max_nodes, budget.max_depth, budget.max_width)


# ----- trees -----------------------------------------------------------------------------------
def tree_to_pb(tree: TokenTree, request_id: int = 0, context_length: int = 0,
               seconds: float = 0.0, assumed_tokens: Sequence[int] = ()) -> drafter_pb2.DraftTree:
    """A ``TokenTree`` as the wire's ``DraftTree`` (probabilities as little-endian float32 bytes); ``assumed_tokens``
    marks a tree drafted ahead for a hypothetical commit (``drafter.proto``)."""
    tokens = tree.tokens.tolist()
    if tokens and max(tokens) >= 2**32:
        raise ValueError(f"drafted token id {max(tokens)} does not fit the wire format (uint32)")
    probs = tree.draft_probs
    if probs is None:
        data, vocab = b"", 0
    else:
        arr = probs.detach().to("cpu", torch.float32).contiguous().numpy()
        data, vocab = arr.astype("<f4", copy=False).tobytes(), int(arr.shape[-1])
    return drafter_pb2.DraftTree(
        request_id=request_id,
        context_length=context_length,
        tokens=tokens,
        parents=tree.parents.tolist(),
        draft_probs=data,
        vocab_size=vocab,
        mode=_MODE_TO_PB[tree.mode],
        draft_seconds=seconds,
        assumed_tokens=[int(t) for t in assumed_tokens],
    )


def tree_from_pb(msg: drafter_pb2.DraftTree) -> TokenTree:
    """Validate and rebuild a ``TokenTree``; raises ``ValueError`` on any malformed field."""
    n = len(msg.tokens)
    if n == 0:
        raise ValueError("drafted tree has no nodes (it needs at least the root)")
    if len(msg.parents) != n:
        raise ValueError(f"drafted tree has {n} tokens but {len(msg.parents)} parents")
    if msg.mode not in _MODE_FROM_PB:
        raise ValueError(f"drafted tree has unknown mode {msg.mode}")
    probs = None
    if msg.draft_probs:
        if msg.vocab_size == 0:
            raise ValueError("drafted tree carries draft_probs but vocab_size is 0")
        want = n * msg.vocab_size * 4
        if len(msg.draft_probs) != want:
            raise ValueError(
                f"draft_probs has {len(msg.draft_probs)} bytes; {n} nodes x vocab {msg.vocab_size} "
                f"x 4 = {want} expected"
            )
        arr = np.frombuffer(msg.draft_probs, dtype="<f4").reshape(n, msg.vocab_size)
        if not np.isfinite(arr).all() or (arr < 0).any():
            raise ValueError("draft_probs has negative or non-finite entries")
        probs = torch.from_numpy(arr.astype(np.float32))
    return TokenTree(
        tokens=torch.tensor(list(msg.tokens), dtype=torch.long),
        parents=torch.tensor(list(msg.parents), dtype=torch.long),
        draft_probs=probs,
        mode=_MODE_FROM_PB[msg.mode],
    )
