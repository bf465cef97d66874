"""GPU prefill of a Mamba2 layer: mamba_ssm's chunk scan when it is importable, else our Triton kernels.

Our own path treats each chunk of the prompt as a chain tree: the tree-scan kernel (chain mode) gives
the chunk's outputs from the carried state, and the replay kernel folds the chunk into the state.
The conv is the tree-conv kernel in chain mode plus the replay kernel's conv-state update.
References: ``ssd_prefill_ref``, ``conv_prefill_ref`` (``ssm_walk``'s exact ones for ``ssd_prefill_exact_triton``).
"""

from __future__ import annotations

import functools

import torch

from stree.kernels.replay_triton import replay_conv_chain_triton, replay_ssm_chain_triton
from stree.kernels.tree_conv_triton import tree_conv1d_triton
from stree.kernels.tree_scan_triton import tree_scan_triton

CHUNK = 64
FP32_BLOCK_M = 32


@functools.lru_cache(maxsize=1)
def mamba_chunk_scan():
    """mamba_ssm's ``mamba_chunk_scan_combined``, or None when mamba_ssm cannot be imported."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:  # not installed, or installed without its CUDA extensions
        return None
    return mamba_chunk_scan_combined


def ssd_prefill_triton(x, dt, A, Bm, Cm, D, ssm_state, chunk_size: int = CHUNK, use_mamba_ssm: bool = True):
    """``ssd_prefill_ref`` on the GPU: returns ``y`` ``[B, T, H, P]``; ``ssm_state`` becomes the final state."""
    b, t, h, p = x.shape
    fn = mamba_chunk_scan() if use_mamba_ssm else None
    if fn is not None:
        y, final = fn(x, dt, A, Bm, Cm, chunk_size=chunk_size, D=D, initial_states=ssm_state.float(),
                      return_final_states=True)
        ssm_state.copy_(final.to(ssm_state.dtype))
        return y
    y = torch.empty_like(x)
    length = torch.empty(b, dtype=torch.long, device=x.device)
    # fp32 chunks run in 32-node tiles (the one-tile kernel over 64 fp32 nodes spills); half chunks in one tile
    block_m = None if x.dtype in (torch.float16, torch.bfloat16) else FP32_BLOCK_M
    for start in range(0, t, chunk_size):
        sl = slice(start, min(start + chunk_size, t))
        xc, dtc, Bc = x[:, sl], dt[:, sl], Bm[:, sl]
        n = xc.shape[1]
        y[:, sl] = tree_scan_triton(xc, dtc, A, Bc, Cm[:, sl], D, length.new_empty(b, n), ssm_state,
                                    is_chain=True, block_m=block_m)
        replay_ssm_chain_triton(ssm_state, xc, dtc, A, Bc, length.fill_(n))
    return y


def ssd_prefill_exact_triton(x, dt, A, Bm, Cm, D, ssm_state):
    """``ssd_prefill_triton`` for the exact numerics: never mamba_ssm's scan, and every chunk in the same node tile
    (one ``CHUNK``-node tile, or ``FP32_BLOCK_M``-node tiles in fp32) whatever the prompt's padded width, so a prompt's
    state and outputs do not depend on the prompts it was prefilled with. Padding (dt = 0) leaves the state as it is
    and only follows real tokens."""
    b, t, h, p = x.shape
    y = torch.empty_like(x)
    length = torch.empty(b, dtype=torch.long, device=x.device)
    half = x.dtype in (torch.float16, torch.bfloat16)
    for start in range(0, t, CHUNK):
        sl = slice(start, min(start + CHUNK, t))
        xc, dtc, Bc = x[:, sl], dt[:, sl], Bm[:, sl]
        n = xc.shape[1]
        y[:, sl] = tree_scan_triton(xc, dtc, A, Bc, Cm[:, sl], D, length.new_empty(b, n), ssm_state, is_chain=True,
                                    block_m=None if half else FP32_BLOCK_M, tile_nodes=CHUNK)
        replay_ssm_chain_triton(ssm_state, xc, dtc, A, Bc, length.fill_(n))
    return y


def conv_prefill_triton(xBC, conv_state, weight, bias):
    """``conv_prefill_ref`` on the GPU: ``silu(conv)`` ``[B, T, C]``; ``conv_state`` rolls forward in place."""
    b, t, c = xBC.shape
    out = tree_conv1d_triton(xBC, conv_state, weight, bias, None, is_chain=True)
    replay_conv_chain_triton(conv_state, xBC, torch.full((b,), t, dtype=torch.long, device=xBC.device))
    return out
