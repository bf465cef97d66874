"""A whole Mamba2 block's decode step as plain PyTorch: residual add + RMSNorm, ``in_proj``, the mixer step
(conv, dt, SSM update, ``y + D x``), the gated RMSNorm and ``out_proj``. Defines the one-launch kernel's math
(``mamba_block_step_triton``) as the composition of the three references it fuses; ``block_step_choice``
times that kernel against the three ops once per shape, as ``norm_linear`` does for its fusions."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from stree.kernels import backend
from stree.kernels.backend import capturing
from stree.kernels.cuda_graph import graphed_fastest
from stree.kernels.mamba_step import mamba_step_ref
from stree.kernels.norm_linear import add_rmsnorm_linear_ref, gated_rmsnorm_linear_ref


class MambaBlockParams(NamedTuple):
    """The weights and settings of one pre-norm Mamba2 block without an MLP half (``d_mlp == 0``)."""

    norm_w: torch.Tensor  # [d] the block's RMSNorm
    norm_eps: float
    residual_in_fp32: bool
    in_w: torch.Tensor  # [d_ssm + C + H, d]: z, xBC, dt
    in_b: Optional[torch.Tensor]
    conv_w: torch.Tensor  # [C, K]
    conv_b: Optional[torch.Tensor]
    dt_bias: torch.Tensor  # [H]
    A: torch.Tensor  # [H] float32, negative
    D: torch.Tensor  # [H] or [H * P]
    ngroups: int
    dt_limit: tuple
    gnorm_w: torch.Tensor  # [d_ssm] the gated RMSNorm
    group_size: int
    gnorm_eps: float
    norm_before_gate: bool
    out_w: torch.Tensor  # [d, d_ssm]
    out_b: Optional[torch.Tensor]


def split_zxbcdt(zxbcdt: torch.Tensor, p: MambaBlockParams):
    """``(z, xBC, dt)`` column slices of ``in_proj``'s output."""
    d_ssm, conv_dim = p.gnorm_w.numel(), p.conv_w.shape[0]
    return torch.split(zxbcdt, [d_ssm, conv_dim, p.dt_bias.numel()], dim=-1)


def mamba_block_step_ref(x: torch.Tensor, residual: Optional[torch.Tensor], p: MambaBlockParams,
                         conv_state: torch.Tensor, ssm_state: torch.Tensor):
    """One token per sequence through the block: ``(out [B, d], new residual [B, d])``; both states in place.
    ``x`` is the previous block's output (the embedding at the first block, with ``residual`` None)."""
    zxbcdt, r = add_rmsnorm_linear_ref(x, residual, p.norm_w, p.norm_eps, p.residual_in_fp32, p.in_w, p.in_b)
    z, xBC, dt = split_zxbcdt(zxbcdt, p)
    y = mamba_step_ref(conv_state, ssm_state, xBC, dt, p.conv_w, p.conv_b, p.dt_bias, p.A, p.D, p.ngroups,
                       p.dt_limit)
    out = gated_rmsnorm_linear_ref(y, z, p.gnorm_w, p.group_size, p.gnorm_eps, p.norm_before_gate, p.out_w, p.out_b)
    return out, r


PROGRAMS_PER_SM = (1, 2, 4)  # the one-launch kernel's grid caps the timing tries
_CHOICE: dict = {}


def block_step_setting() -> str:
    """``STREE_BLOCK_STEP``: ``split`` (the default), ``fused`` or ``auto`` (see ``block_step_choice``); anything
    else is refused."""
    return backend.env_choice("STREE_BLOCK_STEP", ("auto", "split", "fused"), "split")


def block_step_choice(x: torch.Tensor, p: MambaBlockParams, conv_state, ssm_state, split, fused):
    """``"split"`` (norm + ``in_proj``, ``mamba_step``, gated norm + ``out_proj``: three ops) or the programs per
    SM of the one-launch kernel. ``split(cs, hs)`` and ``fused(cs, hs, programs_per_sm)`` run the step on the
    given states.

    ``STREE_BLOCK_STEP`` decides: ``split`` (the default: on the H100 the one launch measured 0.73-0.82x the
    three ops' speed at one row and far less at 16, BENCHMARKS.md §0l), ``fused`` (the one launch, the fastest
    grid cap) or ``auto`` (whichever measured fastest for this shape). Timings run once per shape on copies of
    the states; under capture an undecided shape runs split."""
    from stree.kernels.linear_rows_triton import MAX_ROWS

    forced = block_step_setting()
    if (forced == "split" or backend.resolve(x.device) != "triton" or torch.is_grad_enabled()
            or not 1 <= x.shape[0] <= MAX_ROWS or p.conv_w.shape[1] < 2):
        return "split"
    if not x.is_cuda:  # the Triton backend forced on the CPU (interpreter tests): nothing to time
        return PROGRAMS_PER_SM[0]
    key = (forced, x.shape, p.in_w.shape, p.out_w.shape, ssm_state.shape, p.conv_w.shape, x.dtype, p.in_w.dtype,
           ssm_state.dtype, x.device)
    if key not in _CHOICE:
        if capturing():
            return "split"
        cs, hs = conv_state.clone(), ssm_state.clone()
        tries = {n: (lambda n=n: fused(cs, hs, n)) for n in PROGRAMS_PER_SM}
        if forced == "auto":
            tries = {"split": lambda: split(cs, hs), **tries}
        _CHOICE[key] = graphed_fastest(tries, next(iter(tries)))
    return _CHOICE[key]


def block_step_choices() -> dict:
    """What was decided so far: ``{(rows, in_proj shape, dtype): "split" or programs per SM}`` (benchmarks)."""
    return {(k[1][0], tuple(k[2]), str(k[6]).removeprefix("torch.")): v for k, v in _CHOICE.items()}
