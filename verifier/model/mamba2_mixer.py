"""Mamba2 mixer with mamba_ssm's parameter names, in four modes: full sequence, prefill, one step, tree.

The tree mode caches the activations (x, dt, B and the pre-conv xBC of every node) that
activation replay needs to advance the state along the accepted path without a second pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from stree.kernels import numerics, ops, rowwise
from stree.kernels.pointwise import dt_ref
from stree.kernels.tree_conv_scan import split_xbc

from stree.verifier.model.config import ModelConfig
from stree.verifier.model.linear import Linear


@dataclass
class MambaLayerState:
    conv_state: torch.Tensor  # [B, C, K-1] last K-1 pre-conv inputs, oldest first
    ssm_state: torch.Tensor  # [B, H, P, S] float32


@dataclass
class MambaTreeActs:
    x: torch.Tensor  # [B, N, H, P]
    dt: torch.Tensor  # [B, N, H]
    Bm: torch.Tensor  # [B, N, G, S]
    xBC: torch.Tensor  # [B, N, C] pre-conv


@dataclass
class Projected:
    """A mixer input already through ``in_proj`` (the block fused its pre-norm into that projection)."""

    zxbcdt: torch.Tensor


class GatedRMSNorm(nn.Module):
    """mamba_ssm's RMSNormGated with ``norm_before_gate=False``: ``norm(y * silu(z))`` per group."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rmsnorm(y, z, self.weight, self.group_size, self.eps, self.norm_before_gate)


class Mamba2Mixer(nn.Module):
    """One Mamba2 (SSD) mixer; parameter names match mamba_ssm's ``Mamba2``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = config.ssm
        self.d_model = config.d_model
        self.d_state = cfg["d_state"]
        self.d_conv = cfg["d_conv"]
        self.headdim = cfg["headdim"]
        self.ngroups = cfg["ngroups"]
        self.d_ssm = cfg["d_ssm"]
        self.d_mlp = cfg["d_inner"] - self.d_ssm
        self.nheads = self.d_ssm // self.headdim
        self.conv_dim = self.d_ssm + 2 * self.ngroups * self.d_state
        self.dt_limit = tuple(cfg["dt_limit"])
        self.rmsnorm = cfg["rmsnorm"]
        d_in_proj = 2 * cfg["d_inner"] + 2 * self.ngroups * self.d_state + self.nheads
        self.in_proj = Linear(self.d_model, d_in_proj, bias=cfg["bias"])
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.d_conv, groups=self.conv_dim,
            padding=self.d_conv - 1, bias=cfg["conv_bias"],
        )
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads))
        self.A_log = nn.Parameter(torch.zeros(self.nheads))
        self.D = nn.Parameter(torch.ones(self.d_ssm if cfg["D_has_hdim"] else self.nheads))
        self.D_has_hdim = cfg["D_has_hdim"]
        if self.rmsnorm:
            self.norm = GatedRMSNorm(self.d_ssm, self.d_ssm // self.ngroups, cfg["norm_eps"], cfg["norm_before_gate"])
        self.out_proj = Linear(cfg["d_inner"], self.d_model, bias=cfg["bias"])

    # ----- shared pieces ------------------------------------------------------------------
    def new_state(self, batch: int, device, dtype) -> MambaLayerState:
        return MambaLayerState(
            conv_state=torch.zeros(batch, self.conv_dim, self.d_conv - 1, device=device, dtype=dtype),
            ssm_state=torch.zeros(batch, self.nheads, self.headdim, self.d_state, device=device,
                                  dtype=torch.float32),
        )

    def _split_in(self, u):
        zxbcdt = u.zxbcdt if isinstance(u, Projected) else self.in_proj(u)
        z0, x0, z, xBC, dt = torch.split(
            zxbcdt, [self.d_mlp, self.d_mlp, self.d_ssm, self.conv_dim, self.nheads], dim=-1
        )
        return z0, x0, z, xBC, dt

    def _dt(self, dt_raw: torch.Tensor) -> torch.Tensor:
        return dt_ref(dt_raw, self.dt_bias, self.dt_limit)

    def _A(self) -> torch.Tensor:
        """``A = -exp(A_log)`` in float32, cached until ``A_log`` changes (saves kernels per step)."""
        if torch.is_grad_enabled() and self.A_log.requires_grad:
            return -torch.exp(self.A_log.float())
        key = (self.A_log._version, self.A_log.data_ptr(), self.A_log.device)
        if getattr(self, "_A_key", None) != key:
            self._A_cache = -torch.exp(self.A_log.detach().float())
            self._A_key = key
        return self._A_cache

    def _D(self) -> torch.Tensor:
        # D with a per-channel shape is folded in after the scan (see _finish).
        return torch.zeros(self.nheads, device=self.D.device) if self.D_has_hdim else self.D

    def _split_xbc(self, xbc: torch.Tensor):
        return split_xbc(xbc, self.ngroups, self.headdim, self.d_state)

    def _finish(self, y: torch.Tensor, x: torch.Tensor, z, z0, x0, d_done: bool = False) -> torch.Tensor:
        """Gated norm, the optional MLP half of in_proj, and out_proj (after a per-channel D skip unless the scan
        already added it: ``d_done``)."""
        y = y.reshape(*y.shape[:-2], self.d_ssm)
        if self.D_has_hdim and not d_done:
            y = y + x.reshape(y.shape) * self.D.to(y.dtype)
        return self._gate_out(y, z, z0, x0)

    def _gate_out(self, y: torch.Tensor, z, z0, x0) -> torch.Tensor:
        """``y`` ``[..., d_ssm]`` (D skip included) through the gated norm, the MLP half and out_proj."""
        if self.rmsnorm and self.d_mlp == 0:  # the gated norm and out_proj, in one launch where that is faster
            n = self.norm
            return ops.gated_rmsnorm_linear(y, z, n.weight, n.group_size, n.eps, n.norm_before_gate,
                                            self.out_proj.weight, self.out_proj.bias)
        y = self.norm(y, z) if self.rmsnorm else y * rowwise.silu(z)
        if self.d_mlp > 0:
            y = torch.cat([rowwise.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)

    @property
    def _conv_w(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]  # [C, K]

    # ----- modes ----------------------------------------------------------------------------
    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Whole sequences from a zero state (training and scoring); ``u`` is ``[B, T, d]``."""
        b = u.shape[0]
        state = self.new_state(b, u.device, u.dtype)
        return self.prefill(u, state)

    def prefill(self, u: torch.Tensor, state: MambaLayerState, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """T tokens continuing from ``state`` (updated in place).

        With ``lengths`` ``[B]`` only row b's first ``lengths[b]`` tokens are real (right padding): padding gets
        dt = 0, so it neither decays nor feeds the SSM state, and the conv state ends at each row's last real token.
        """
        z0, x0, z, xBC, dt_raw = self._split_in(u)
        dt, hist = self._dt(dt_raw), None
        if lengths is not None:
            dt = dt * (torch.arange(u.shape[1], device=u.device)[None, :] < lengths[:, None])[..., None]
            if self.d_conv > 1:  # old conv state + pre-conv inputs, [B, C, K-1+T]
                hist = torch.cat([state.conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=2)
        xbc = ops.conv_prefill(xBC, state.conv_state, self._conv_w, self.conv1d.bias)
        if hist is not None:  # conv_prefill rolled the conv state to the padded end: take each row's real end
            idx = lengths[:, None] + torch.arange(self.d_conv - 1, device=u.device)[None, :]
            state.conv_state.copy_(hist.gather(2, idx[:, None, :].expand(-1, hist.shape[1], -1)))
        x, Bm, Cm = self._split_xbc(xbc)
        y = ops.ssd_prefill(x, dt, self._A(), Bm, Cm, self._D(), state.ssm_state)
        return self._finish(y, x, z, z0, x0)

    def step(self, u: "torch.Tensor | Projected", state: MambaLayerState, source: "MambaLayerState | None" = None,
             rows: "torch.Tensor | None" = None) -> torch.Tensor:
        """One token per sequence; ``u`` is ``[B, d]`` (or already through in_proj); state updated in place, or, with
        ``source``, ``state`` receives row b stepped from ``source``'s row ``rows[b]`` (row b without ``rows``)."""
        z0, x0, z, xBC, dt_raw = self._split_in(u)
        read = state if source is None else source
        y = ops.mamba_step(read.conv_state, read.ssm_state, xBC, dt_raw, self._conv_w, self.conv1d.bias,
                           self.dt_bias, self._A(), self.D, self.ngroups, self.dt_limit,
                           getattr(self, "activation", "silu"), src_rows=rows,
                           new_states=None if source is None else (state.conv_state, state.ssm_state))
        return self._gate_out(y, z, z0, x0)

    def tree(self, u: "torch.Tensor | Projected", state: MambaLayerState, parents: torch.Tensor,
             is_chain: bool = False, acts_out=None):
        """Every node of a padded tree batch (``u`` is ``[B, N, d]``, or already through in_proj); state is read,
        not changed.
        ``is_chain``: every row of ``parents`` is the chain ``i - 1`` (lets the kernel skip the parent walk).
        ``acts_out``: ``(xbc, dt, xBC)`` buffers the commit's activations go to (slices of a model-wide stack)."""
        z0, x0, z, xBC, dt_raw = self._split_in(u)
        exact = numerics.exact()  # the decode step's own D skip (per channel too), inside the scan
        y, xbc, dt = ops.tree_conv_scan(xBC, state.conv_state, self._conv_w, self.conv1d.bias, parents, dt_raw,
                                        self.dt_bias, self.dt_limit, getattr(self, "activation", "silu"), self._A(),
                                        self.D if exact else self._D(), self.ngroups, self.headdim, state.ssm_state,
                                        is_chain=is_chain, acts_out=acts_out)
        x, Bm, _ = self._split_xbc(xbc)
        pre = acts_out[2] if acts_out is not None else xBC
        return self._finish(y, x, z, z0, x0, d_done=exact), MambaTreeActs(x=x, dt=dt, Bm=Bm, xBC=pre)

    def commit(self, state: MambaLayerState, acts: MambaTreeActs, path, path_len) -> None:
        """Advance ``state`` along the accepted path by activation replay (in place)."""
        ops.replay(state.ssm_state, state.conv_state, acts.x, acts.dt, self._A(), acts.Bm, acts.xBC,
                   path, path_len)
