"""Tree verification as device code: batched greedy and recursive rejection sampling, fixed shapes.

No host sync or value-dependent Python branch, so a decode step can be captured in one CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from stree.kernels import ops
from stree.protocols.token_tree import DraftMode, TokenTree


@dataclass
class DeviceVerifyResult:
    """Per-row outcome; every tensor lives on the input's device."""

    path: torch.Tensor  # [B, max_depth + 1] node ids from the root, 0 after path_len
    path_len: torch.Tensor  # [B] accepted nodes including the root (>= 1)
    bonus: torch.Tensor  # [B] the target's token after the last accepted node
    out_tokens: torch.Tensor  # [B, max_depth + 1] accepted tokens after the root, the bonus, then 0
    num_out: torch.Tensor  # [B] emitted tokens (= path_len)


def tree_bounds(trees: Sequence[TokenTree]) -> tuple[int, int]:
    """Host-side helper: (max depth, max children of one node) over ``trees``, for the static bounds."""
    depth = max(t.max_depth for t in trees)
    width = max((max((len(k) for k in t.children()), default=0) for t in trees), default=0)
    return depth, width


def verify_batch(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    mode: DraftMode,
    draft_probs: Optional[torch.Tensor],
    uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    max_depth: int,
    max_width: int,
    prob_dtype: torch.dtype = torch.float32,
    sampling: bool = True,
) -> DeviceVerifyResult:
    """Verify B padded trees of N nodes at once; rows with ``temperature == 0`` are greedy.

    ``logits[b, i]`` scores the token after node i; ``draft_probs[b, i]`` is the draft law of node
    i's children (needed unless ``mode`` is deterministic). Child i is accepted iff
    ``uniforms[b, i] * q(x_i) < p(x_i)``; the bonus after final node f is
    ``sample_inverse_cdf(residual, bonus_uniforms[b, f])``. Probabilities are warped in float32
    (as ``warp_logits``) and then handled in ``prob_dtype`` (float64 reproduces the CPU reference
    ``verify.verify_tree`` given the same uniforms exactly).

    Contract, not checked on device (that would sync): ``parents[:, 0] == -1``, ``parents[b, i] < i``,
    padding nodes have parent 0 and ``valid`` False, logits give finite distributions, uniforms lie
    in [0, 1). Nodes deeper than ``max_depth`` or past the first ``max_width`` children of their
    parent are never accepted: the same as verifying the truncated tree, so the law stays exact.
    ``sampling=False`` (a static promise that every row is greedy) skips the sampling walk; ``top_k`` /
    ``top_p`` ``None`` (no row filters) skips their sorts. On the GPU the whole walk runs as one Triton launch
    (``ops.sampled_verify``; with filters, on logits filtered first; the walk in ``kernels/sampled_verify.py``
    is its reference).
    """
    mode = DraftMode(mode)
    _check_shapes(tokens, parents, valid, logits, mode, draft_probs, uniforms, bonus_uniforms,
                  max_depth, max_width)
    if not sampling:  # every row greedy: argmax, then one fused launch on the GPU
        path, path_len, bonus, out = ops.greedy_verify(tokens, parents, valid, logits.argmax(-1),
                                                       max_depth, max_width)
        return DeviceVerifyResult(path=path, path_len=path_len, bonus=bonus, out_tokens=out, num_out=path_len)
    path, path_len, bonus, out = ops.sampled_verify(tokens, parents, valid, logits, temperature, top_k, top_p, mode,
                                                    draft_probs, uniforms, bonus_uniforms, max_depth, max_width,
                                                    prob_dtype)
    return DeviceVerifyResult(path=path, path_len=path_len, bonus=bonus, out_tokens=out,
                              num_out=path_len)


def _check_shapes(tokens, parents, valid, logits, mode, draft_probs, uniforms, bonus_uniforms,
                  max_depth, max_width) -> None:
    """Static checks only (shapes, Python ints): nothing here reads a tensor's values."""
    if tokens.dim() != 2:
        raise ValueError(f"verify_batch: tokens must be [B, N], got {tuple(tokens.shape)}")
    b, n = tokens.shape
    for name, t in (("parents", parents), ("valid", valid), ("uniforms", uniforms),
                    ("bonus_uniforms", bonus_uniforms)):
        if tuple(t.shape) != (b, n):
            raise ValueError(f"verify_batch: {name} must be [{b}, {n}], got {tuple(t.shape)}")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (b, n):
        raise ValueError(f"verify_batch: logits must be [{b}, {n}, V], got {tuple(logits.shape)}")
    if mode is not DraftMode.DETERMINISTIC:
        if draft_probs is None:
            raise ValueError(f"verify_batch: mode {mode.value!r} needs draft_probs")
        if tuple(draft_probs.shape) != tuple(logits.shape):
            raise ValueError(
                f"verify_batch: draft_probs must match logits {tuple(logits.shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )
    for name, bound in (("max_depth", max_depth), ("max_width", max_width)):
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ValueError(f"verify_batch: {name} must be a Python int >= 0, got {bound!r}")
