"""One whole Mamba2 decode step after in_proj, as plain PyTorch: conv (state roll), activation,
dt softplus (+clamp), SSM state update, ``y`` and the D skip. Defines the fused kernel's math, in place or out
of place with each row stepping the state of a chosen source row (beams following their parents). Built from the
exact references' pieces (``ssm_walk``), so a tree pass or commit of the exact numerics reproduces its bits."""

from __future__ import annotations

import torch

from stree.kernels.pointwise import dt_ref
from stree.kernels.ssm_walk import conv_window_ref, ssm_output_ref, ssm_update_ref
from stree.kernels.tree_scan import heads_from_groups


def mamba_step_ref(
    conv_state: torch.Tensor,  # [B, C, K-1] pre-conv inputs, oldest first; updated in place (no new_states)
    ssm_state: torch.Tensor,  # [B, H, P, S] float32; updated in place (no new_states)
    xBC: torch.Tensor,  # [B, C] pre-conv input of the new token, C = H*P + 2*G*S
    dt_raw: torch.Tensor,  # [B, H] before bias and softplus
    conv_w: torch.Tensor,  # [C, K]
    conv_b: torch.Tensor | None,  # [C]
    dt_bias: torch.Tensor,  # [H]
    A: torch.Tensor,  # [H] negative
    D: torch.Tensor,  # [H] or [H*P]
    ngroups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str = "silu",
    *,
    src_rows: torch.Tensor | None = None,  # [B] integers: row b steps the state of row src_rows[b]
    new_states: tuple[torch.Tensor, torch.Tensor] | None = None,  # (conv [B, C, K-1], ssm [B, H, P, S]) out
) -> torch.Tensor:
    """Returns ``y + D x`` as ``[B, H*P]`` in ``xBC``'s dtype. With ``new_states`` the given states are only read
    (rows ``src_rows``, or row b for row b) and may hold another number of rows; the stepped states go there."""
    out_conv, out_ssm = check_step_rows(conv_state, ssm_state, xBC.shape[0], src_rows, new_states)
    if src_rows is not None:
        conv_state, ssm_state = conv_state[src_rows], ssm_state[src_rows]
    b, h, p, s = ssm_state.shape
    window = torch.cat([conv_state.to(xBC.dtype), xBC[:, :, None]], dim=2).float()
    if conv_state.shape[2] > 0:
        out_conv.copy_(window[:, :, 1:].to(out_conv.dtype))
    xbc = conv_window_ref(window, conv_w, conv_b, activation).to(xBC.dtype).float()  # rounded like the tree's
    x = xbc[:, : h * p].reshape(b, h, p)
    Bh = heads_from_groups(xbc[:, h * p: h * p + ngroups * s].reshape(b, ngroups, s), h)
    Ch = heads_from_groups(xbc[:, h * p + ngroups * s:].reshape(b, ngroups, s), h)
    new = ssm_update_ref(ssm_state.float(), dt_ref(dt_raw, dt_bias, dt_limit), A, x, Bh)
    out_ssm.copy_(new.to(out_ssm.dtype))
    return ssm_output_ref(new, Ch, D, x).reshape(b, h * p).to(xBC.dtype)


def check_step_rows(conv_state, ssm_state, rows: int, src_rows, new_states) -> tuple[torch.Tensor, torch.Tensor]:
    """The states a step of ``rows`` rows writes (``new_states``, else the given ones, in place), after checking
    that they fit: ``src_rows`` needs ``new_states`` (stepping in place from other rows would overwrite a row that
    another still reads), and its values name rows of the given states (checked here for host tensors; on the GPU
    ``StreeLM.step`` checks them once per step, outside graph capture)."""
    if new_states is None:
        if src_rows is not None:
            raise ValueError("mamba_step: src_rows needs new_states (a step from other rows cannot run in place)")
        if ssm_state.shape[0] != rows:
            raise ValueError(f"mamba_step: ssm_state has {ssm_state.shape[0]} rows, the step {rows}")
        return conv_state, ssm_state
    out_conv, out_ssm = new_states
    if (out_conv.shape != (rows, *conv_state.shape[1:]) or out_ssm.shape != (rows, *ssm_state.shape[1:])
            or out_conv.dtype != conv_state.dtype or out_ssm.dtype != ssm_state.dtype):
        raise ValueError(f"mamba_step: new_states {tuple(out_conv.shape)} / {tuple(out_ssm.shape)} must be the "
                         f"states' rows [{rows}, ...] in their dtypes")
    if out_conv.data_ptr() == conv_state.data_ptr() or out_ssm.data_ptr() == ssm_state.data_ptr():
        raise ValueError("mamba_step: new_states must not be the states it reads")
    if src_rows is None:
        if ssm_state.shape[0] != rows:
            raise ValueError(f"mamba_step: ssm_state has {ssm_state.shape[0]} rows, the step {rows} (no src_rows)")
    elif src_rows.shape != (rows,) or src_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mamba_step: src_rows must be [{rows}] integers, got {src_rows.dtype} "
                         f"{tuple(src_rows.shape)}")
    elif not src_rows.is_cuda and rows and (int(src_rows.min()) < 0 or int(src_rows.max()) >= ssm_state.shape[0]):
        raise ValueError(f"mamba_step: src_rows must name rows 0..{ssm_state.shape[0] - 1}")
    return out_conv, out_ssm
