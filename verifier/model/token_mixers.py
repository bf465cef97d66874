"""Per-token mixer layers (a plain MLP or a routed MoE) that take a block's mixer slot, as NemotronH's do.

They hold no recurrent state and need no tree logic: each node is transformed on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from stree.kernels import numerics, ops, rowwise
from stree.verifier.model.linear import Linear


@dataclass
class NoLayerState:
    """The (empty) inference state of a per-token layer; it has no tensors to copy, select or graph."""


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS = {"relu2": relu2, "silu": rowwise.silu}


def per_expert(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[T, E, out]``: expert e's ``weight[e]`` (``[E, out, in]``) applied to ``x`` (``[T, in]``, or ``[T, E, in]``:
    expert e's own input). In exact numerics one ``ops.linear`` per expert (a row's result independent of the
    token count), else one einsum."""
    own = x.dim() == 3
    if numerics.exact():
        return torch.stack([ops.linear(x[:, e] if own else x, weight[e]) for e in range(weight.shape[0])], 1)
    return torch.einsum("ted,eid->tei" if own else "td,eid->tei", x, weight)


def mix_chosen(out: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_k weights[:, k] out[:, idx[:, k]]`` (``out`` ``[T, E, d]``) in float32, summed in a fixed order."""
    chosen = out.gather(1, idx[..., None].expand(*idx.shape, out.shape[-1]))  # [T, k, d]
    return rowwise.fixed_sum(chosen.float() * weights[..., None], 1).to(dtype)


class TokenMLP(nn.Module):
    """``down(act(up(x)))`` (no gate), as NemotronH's MLP layers and shared experts."""

    def __init__(self, d_model: int, hidden: int, act: str, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(d_model, hidden, bias=bias)
        self.down_proj = Linear(hidden, d_model, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class Experts(nn.Module):
    """Ungated expert MLPs stored as ``[E, out, in]`` tensors."""

    def __init__(self, n: int, d_model: int, hidden: int, act: str):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(n, hidden, d_model))
        self.down_proj = nn.Parameter(torch.zeros(n, d_model, hidden))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (shape-static, so it graphs), then the chosen ones mixed by ``weights``."""
        out = per_expert(self.act(per_expert(x, self.up_proj)), self.down_proj)  # [T, E, d]
        return mix_chosen(out, idx, weights, x.dtype)


class SigmoidRouter(nn.Module):
    """Sigmoid scores plus a correction bias pick the top-k experts (within the top groups); weights from the raw scores."""

    def __init__(self, n: int, d_model: int, top_k: int, n_group: int, topk_group: int, norm_topk: bool,
                 scale: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, d_model))
        self.register_buffer("e_score_correction_bias", torch.zeros(n))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk, self.scale = norm_topk, scale

    def forward(self, x: torch.Tensor):
        scores = rowwise.sigmoid(ops.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(choice.shape[0], self.n_group, -1)
            group_scores = rowwise.fixed_sum(grouped.topk(2, dim=-1)[0], -1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
            choice = choice.masked_fill(~keep.bool()[..., None].expand_as(grouped).reshape_as(choice), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (rowwise.fixed_sum(weights, -1)[..., None] + 1e-20)
        return idx, weights * self.scale


class MoE(nn.Module):
    """Routed experts plus an always-on shared expert MLP; with ``latent`` the routed experts work in a
    ``latent``-wide space between two projections (``fc1_latent_proj``, ``fc2_latent_proj``)."""

    def __init__(self, d_model: int, spec: dict):
        super().__init__()
        act, bias, latent = spec["act"], bool(spec.get("bias", False)), spec.get("latent")
        self.gate = SigmoidRouter(spec["n_experts"], d_model, spec["top_k"], spec.get("n_group", 1),
                                  spec.get("topk_group", 1), spec.get("norm_topk", True), spec.get("scale", 1.0))
        self.experts = Experts(spec["n_experts"], latent or d_model, spec["hidden"], act)
        self.shared_experts = TokenMLP(d_model, spec["shared_hidden"], act, bias)
        if latent:
            self.fc1_latent_proj = Linear(d_model, latent, bias=bias)
            self.fc2_latent_proj = Linear(latent, d_model, bias=bias)
        self.latent = bool(latent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.gate(flat)
        if self.latent:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(flat), idx, weights))
        else:
            routed = self.experts(flat, idx, weights)
        return routed.reshape(x.shape) + self.shared_experts(x)


def token_mixer(d_model: int, spec: dict) -> nn.Module:
    """The module a ``layer_mixers`` entry names: ``{"kind": "mlp", "hidden", "act"}`` or ``{"kind": "moe", ...}``."""
    kind = spec.get("kind")
    if spec.get("act") not in ACTIVATIONS:
        raise ValueError(f"config: layer_mixers act {spec.get('act')!r} is not one of {sorted(ACTIVATIONS)}")
    if kind == "mlp":
        return TokenMLP(d_model, int(spec["hidden"]), spec["act"], bool(spec.get("bias", False)))
    if kind == "moe":
        return MoE(d_model, spec)
    raise ValueError(f"config: layer_mixers kind {kind!r} is not 'mlp' or 'moe'")


class SoftmaxMoEMLP(nn.Module):
    """Softmax-over-top-k routed gated experts plus a shared gated MLP (GraniteMoeHybrid's MLP slot).

    Expert and shared weights keep [gate; up] halves, as the checkpoint stores them.
    """

    def __init__(self, d_model: int, spec: dict):
        super().__init__()
        n, hidden = spec["n_experts"], spec["hidden"]
        self.top_k = spec["top_k"]
        self.routed = n > 0  # no experts: the shared MLP alone (GraniteMoeHybrid with num_local_experts=0)
        if self.routed:
            self.router = Linear(d_model, n, bias=False)
            self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * hidden, d_model))
            self.down_proj = nn.Parameter(torch.zeros(n, d_model, hidden))
        self.shared_in = Linear(d_model, 2 * spec["shared_hidden"], bias=False)
        self.shared_out = Linear(spec["shared_hidden"], d_model, bias=False)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = rowwise.softmax(top, dim=-1)
        gate, up = per_expert(x, self.gate_up_proj).chunk(2, dim=-1)
        out = per_expert(rowwise.silu(gate) * up, self.down_proj)  # every expert: shape-static
        return mix_chosen(out, idx, weights, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.shared_in(x).chunk(2, dim=-1)
        shared = self.shared_out(rowwise.silu(gate) * up)
        if not self.routed:
            return shared
        return self._routed(x.reshape(-1, x.shape[-1])).reshape(x.shape) + shared
