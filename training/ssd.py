"""The SSD (Mamba2 scan) of whole training sequences from a zero state, with a backward pass.

On CUDA with mamba_ssm importable this is its chunked SSD Triton kernels (``mamba_chunk_scan_combined``: forward
and backward); everywhere else ``ssd_chunked_ref``, the same chunked algorithm in plain PyTorch with every chunk
at once (the quadratic form inside a chunk, the states passed between chunks by a small segment-sum matrix), which
autograd differentiates. ``kernels.chunk_scan.ssd_prefill_ref`` (one chunk after another) is its reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from stree.kernels.mamba_ssm_import import mamba_ssm_attr
from stree.kernels.tree_scan import heads_from_groups

CHUNK = 64  # the reference's chunk: its [chunk, chunk] blocks are per head
KERNEL_CHUNK = 256  # mamba_ssm's default chunk for its kernels


@functools.lru_cache(maxsize=1)
def mamba_chunk_scan_combined():
    """mamba_ssm's ``mamba_chunk_scan_combined`` (Triton forward and backward), or None."""
    return mamba_ssm_attr("ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def ssd_backend(device) -> str:
    """Which SSD ``ssd_train`` runs on ``device``: ``mamba_ssm`` (its Triton kernels) or ``torch`` (the reference)."""
    return "mamba_ssm" if torch.device(device).type == "cuda" and mamba_chunk_scan_combined() is not None else "torch"


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` (0 on the diagonal), ``-inf`` above it."""
    n = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunked_ref(x, dt, A, Bm, Cm, D, chunk_size: int = CHUNK) -> torch.Tensor:
    """``y`` ``[B, T, H, P]`` of the SSD from a zero state; ``dt`` ``[B, T, H]`` after softplus, ``A``/``D`` ``[H]``,
    ``Bm``/``Cm`` ``[B, T, G, S]``. Float32 inside; differentiable in every input."""
    b, t, h, p = x.shape
    pad = (-t) % chunk_size  # padding steps get dt = 0: they neither decay nor feed the state
    xf, dtf = x.float(), dt.float()
    Bf, Cf = heads_from_groups(Bm.float(), h), heads_from_groups(Cm.float(), h)
    if pad:
        xf, dtf = F.pad(xf, (0, 0, 0, 0, 0, pad)), F.pad(dtf, (0, 0, 0, pad))
        Bf, Cf = F.pad(Bf, (0, 0, 0, 0, 0, pad)), F.pad(Cf, (0, 0, 0, 0, 0, pad))
    c, q = (t + pad) // chunk_size, chunk_size
    xc = xf.reshape(b, c, q, h, p)
    dtc = dtf.reshape(b, c, q, h)
    Bc, Cc = Bf.reshape(b, c, q, h, -1), Cf.reshape(b, c, q, h, -1)
    a = (dtc * A.float()).permute(0, 3, 1, 2)  # [b, h, c, q]
    a_cum = torch.cumsum(a, dim=-1)
    # within each chunk: y_i = sum_{j<=i} C_i.B_j exp(a_{j+1..i}) dt_j x_j
    decay = torch.exp(segsum(a))  # [b, h, c, q, q]
    y_diag = torch.einsum("bclhn,bcshn,bhcls,bcsh,bcshp->bclhp", Cc, Bc, decay, dtc, xc)
    # each chunk's own final state, then the states entering each chunk (a scan over chunks)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, q]
    states = torch.einsum("bclhn,bhcl,bclh,bclhp->bchpn", Bc, to_end, dtc, xc)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # zero state before chunk 0
    chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]  # [b, c, h, p, n]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, entering, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(b, c * q, h, p)[:, :t]
    return y + x.float() * D.float()[:, None]


def softplus_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple) -> torch.Tensor:
    """Mamba2's step size: ``softplus(dt_raw + dt_bias)``, clamped to ``dt_limit`` where it is not ``(0, inf)``."""
    dt = F.softplus(dt_raw.float() + dt_bias.float())
    lo, hi = dt_limit
    return dt.clamp(lo, hi) if lo > 0.0 or hi < float("inf") else dt


def ssd_train(x, dt_raw, A, Bm, Cm, D, dt_bias, dt_limit: tuple, use_kernel: bool = True) -> torch.Tensor:
    """The SSD of a Mamba2 layer over whole sequences (dt softplus and limit included): ``y`` ``[B, T, H, P]`` in
    ``x``'s dtype. mamba_ssm's kernels on CUDA where importable (``use_kernel``), else ``ssd_chunked_ref``."""
    fn = mamba_chunk_scan_combined() if use_kernel and x.is_cuda else None
    if fn is not None:
        lo, hi = dt_limit
        return fn(x, dt_raw, A, Bm, Cm, chunk_size=KERNEL_CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True,
                  dt_limit=(float(lo), float(hi)))
    return ssd_chunked_ref(x, softplus_dt(dt_raw, dt_bias, dt_limit), A, Bm, Cm, D).to(x.dtype)
