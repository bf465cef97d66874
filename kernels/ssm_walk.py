"""The exact numerics' Mamba2 SSM and conv references: every token's state is the decode step's recurrence.

A tree node's state is its parent's state stepped once, ``H_i = exp(dt_i A) H_parent + (dt_i x_i) B_i^T``, with
the same operations in the same order as ``mamba_step_ref`` (and rounded to the state's dtype after every step,
as a stored state is); its output is ``y_i = sum_s H_i C_i + D x_i``. So a node's output equals what one-token
decode steps along its path give, bit for bit, and the commit (``replay_exact_ref``) replays the accepted path with
the same step and leaves the decode step's state. The conv takes its taps oldest first, as the step does. Prefill
(``ssd_prefill_exact_ref``, ``conv_prefill_exact_ref``) is the same recurrence over a chain, so a prompt's state does
not depend on what it was prefilled with or padded to. All sums are ``rowwise.fixed_sum`` and all transcendental
functions ``rowwise`` ones: a row's result never depends on the tensor around it.

The Triton kernels (``ssm_walk_triton``, ``mamba_step_triton``, ``replay_triton``) follow the same order with
fused multiply-adds; they match these references closely and each other exactly.
"""

from __future__ import annotations

import torch

from stree.kernels import rowwise
from stree.kernels.pointwise import conv_activation, dt_ref
from stree.kernels.tree_conv import tree_conv_taps
from stree.kernels.tree_conv_scan import split_xbc
from stree.kernels.tree_scan import heads_from_groups


def conv_window_ref(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str = "silu") -> torch.Tensor:
    """``act(sum_j window[..., j] w[:, j] + bias)`` in float32 over ``window`` ``[..., C, K]`` (taps oldest first,
    added one after another)."""
    w = weight.float()
    acc = window[..., 0] * w[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + window[..., j] * w[:, j]
    if bias is not None:
        acc = acc + bias.float()
    return conv_activation(activation)(acc)


def ssm_update_ref(h: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, x: torch.Tensor, Bh: torch.Tensor):
    """``exp(dt A) h + (dt x) B^T``: ``h`` ``[..., H, P, S]`` fp32, ``dt`` ``[..., H]``, ``x`` ``[..., H, P]``,
    ``Bh`` ``[..., H, S]`` (heads expanded)."""
    decay = rowwise.exp(dt * A.float())
    return h * decay[..., None, None] + (dt[..., None] * x)[..., None] * Bh[..., None, :]


def ssm_output_ref(new: torch.Tensor, Ch: torch.Tensor, D: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_s new C + D x`` (``D`` ``[H]`` per head or ``[H * P]`` per channel), float32 ``[..., H, P]``."""
    h, p = x.shape[-2:]
    return rowwise.fixed_sum(new * Ch[..., None, :], -1) + D.float().reshape(h, -1) * x


def _carry(new: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The state the next step reads (rounded to the stored state's dtype)."""
    return new.to(dtype).float()


def tree_conv_exact_ref(xBC, conv_state, weight, bias, parents, activation: str = "silu") -> torch.Tensor:
    """The tree conv (``tree_conv1d_ref``'s semantics) with the step's tap order: ``[B, N, C]`` in ``xBC``'s dtype."""
    width = weight.shape[1]
    ext = torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), xBC], dim=1).float()  # [B, K-1+N, C]
    taps = tree_conv_taps(parents, width).flip(-1)  # [B, N, K], oldest first
    b, n, _ = taps.shape
    rows = torch.gather(ext, 1, taps.reshape(b, n * width, 1).expand(-1, -1, ext.shape[-1]))
    window = rows.reshape(b, n, width, -1).transpose(2, 3)  # [B, N, C, K]
    return conv_window_ref(window, weight, bias, activation).to(xBC.dtype)


def ssm_tree_walk_ref(x, dt, A, Bm, Cm, D, parents, ssm_state) -> torch.Tensor:
    """``y`` ``[B, N, H, P]`` (``x``'s dtype) of every node: its parent's state stepped once (the committed state for
    the root); ``ssm_state`` is read only. Nodes are in topological order (``parents[:, i] < i``)."""
    b, n, nheads, _ = x.shape
    xf, Bh, Ch = x.float(), heads_from_groups(Bm.float(), nheads), heads_from_groups(Cm.float(), nheads)
    rows = torch.arange(b, device=x.device)
    states = torch.empty(b, n, *ssm_state.shape[1:], device=x.device)
    y = torch.empty(b, n, *x.shape[2:], device=x.device)
    for i in range(n):
        par = parents[:, i]
        base = torch.where((par >= 0)[:, None, None, None], states[rows, par.clamp(min=0)], ssm_state.float())
        new = ssm_update_ref(base, dt[:, i].float(), A, xf[:, i], Bh[:, i])
        y[:, i] = ssm_output_ref(new, Ch[:, i], D, xf[:, i])
        states[:, i] = _carry(new, ssm_state.dtype)
    return y.to(x.dtype)


def tree_conv_scan_exact_ref(xBC, conv_state, conv_w, conv_b, parents, dt_raw, dt_bias, dt_limit, activation,
                             A, D, ngroups: int, headdim: int, ssm_state, is_chain: bool = False):
    """The exact tree pass after in_proj: ``(y [B, N, H, P], xbc [B, N, C] post-conv, dt [B, N, H] float32)``,
    ``tree_conv_scan_ref``'s contract with ``D`` per head ``[H]`` or per channel ``[H * P]``."""
    xbc = tree_conv_exact_ref(xBC, conv_state, conv_w, conv_b, parents, activation)
    dt = dt_ref(dt_raw, dt_bias, dt_limit)
    x, Bm, Cm = split_xbc(xbc, ngroups, headdim, ssm_state.shape[-1])
    return ssm_tree_walk_ref(x, dt, A, Bm, Cm, D, parents, ssm_state), xbc, dt


def replay_exact_ref(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len) -> None:
    """``replay_ref``'s contract by the step's recurrence: one step per accepted node, in place."""
    b, m = path.shape
    nheads = x.shape[2]
    rows = torch.arange(b, device=path.device)
    state = ssm_state.float()
    for k in range(m):
        node = path[:, k].clamp(min=0)
        new = ssm_update_ref(state, dt[rows, node].float(), A, x[rows, node].float(),
                             heads_from_groups(Bm[rows, node].float(), nheads))
        state = torch.where((k < path_len)[:, None, None, None], _carry(new, ssm_state.dtype), state)
    ssm_state.copy_(state.to(ssm_state.dtype))
    km1 = conv_state.shape[2]
    if km1 > 0:
        p = torch.where(torch.arange(m, device=path.device)[None, :] < path_len[:, None], path, 0)
        picked = torch.gather(xBC, 1, p[:, :, None].expand(-1, -1, xBC.shape[2]))  # [B, M, C]
        ext = torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), picked], dim=1)  # [B, K-1+M, C]
        take = path_len[:, None] + torch.arange(km1, device=path.device)[None, :]
        conv_state.copy_(torch.gather(ext, 1, take[:, :, None].expand(-1, -1, ext.shape[2])).transpose(1, 2)
                         .to(conv_state.dtype))


def replay_layers_exact_ref(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len) -> None:
    """``replay_exact_ref`` on every layer of stacked ``[L, ...]`` tensors."""
    for layer in range(ssm_state.shape[0]):
        replay_exact_ref(ssm_state[layer], conv_state[layer], x[layer], dt[layer], A[layer], Bm[layer], xBC[layer],
                         path, path_len)


def ssd_prefill_exact_ref(x, dt, A, Bm, Cm, D, ssm_state) -> torch.Tensor:
    """``ssd_prefill_ref``'s contract by the step's recurrence token after token: ``y`` ``[B, T, H, P]``; the state
    becomes the final state in place. Padding (dt = 0) leaves the state as it is."""
    b, t, nheads, _ = x.shape
    xf, Bh, Ch = x.float(), heads_from_groups(Bm.float(), nheads), heads_from_groups(Cm.float(), nheads)
    state = ssm_state.float()
    ys = []
    for i in range(t):
        new = ssm_update_ref(state, dt[:, i].float(), A, xf[:, i], Bh[:, i])
        ys.append(ssm_output_ref(new, Ch[:, i], D, xf[:, i]))
        state = _carry(new, ssm_state.dtype)
    ssm_state.copy_(state.to(ssm_state.dtype))
    return (torch.stack(ys, 1) if ys else xf).to(x.dtype)


def conv_prefill_exact_ref(xBC, conv_state, weight, bias) -> torch.Tensor:
    """``conv_prefill_ref``'s contract with the step's tap order: ``silu(conv)`` ``[B, T, C]``; the conv state
    rolls forward in place."""
    width, t = weight.shape[1], xBC.shape[1]
    ext = torch.cat([conv_state.transpose(1, 2).to(xBC.dtype), xBC], dim=1).float()  # [B, K-1+T, C]
    window = torch.stack([ext[:, j: j + t] for j in range(width)], dim=-1)  # [B, T, C, K]
    out = conv_window_ref(window, weight, bias).to(xBC.dtype)
    if width > 1:
        conv_state.copy_(ext[:, -(width - 1):].transpose(1, 2).to(conv_state.dtype))
    return out
