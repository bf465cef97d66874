"""Tree conv1d in one Triton launch: each node's depthwise causal conv over its own ancestors, then SiLU.

Tap k of node i is its k-th ancestor, found by walking ``parents`` in-kernel; taps above the root
read the committed conv state. Also serves prefill (``is_chain``: ``parents[i] = i - 1``).
Reference: ``tree_conv1d_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_conv_kernel(
    xbc_ptr, cs_ptr, w_ptr, bias_ptr, par_ptr, out_ptr,
    N, C,
    s_xb, s_xn, s_xc,
    s_sb, s_sc, s_sk,
    s_wc, s_wk,
    s_pb, s_pn,
    s_ob, s_on, s_oc,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, IS_CHAIN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ch_ok = ch < C
    ok = row_ok[:, None] & ch_ok[None, :]

    if HAS_BIAS:
        acc = tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :] + tl.zeros(
            [BLOCK_N, BLOCK_C], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    # cur >= 0: a tree node; cur == -m: the m-th most recent committed input (state column K-1-m).
    cur = rows
    for k in tl.static_range(K):
        wk = tl.load(w_ptr + ch * s_wc + (K - 1 - k) * s_wk, mask=ch_ok, other=0.0).to(tl.float32)
        in_tree = cur >= 0
        v_tree = tl.load(xbc_ptr + b * s_xb + cur[:, None] * s_xn + ch[None, :] * s_xc,
                         mask=ok & in_tree[:, None], other=0.0)
        col = K - 1 + cur
        v_state = tl.load(cs_ptr + b * s_sb + ch[None, :] * s_sc + col[:, None] * s_sk,
                          mask=ok & (~in_tree & (col >= 0))[:, None], other=0.0)
        acc += (v_tree.to(tl.float32) + v_state.to(tl.float32)) * wk[None, :]
        if k + 1 < K:
            if IS_CHAIN:
                cur = cur - 1
            else:
                up = tl.load(par_ptr + b * s_pb + cur * s_pn, mask=row_ok & (cur > 0), other=0).to(tl.int32)
                cur = tl.where(cur > 0, tl.minimum(tl.maximum(up, -1), cur - 1), cur - 1)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * s_ob + rows[:, None] * s_on + ch[None, :] * s_oc,
             out.to(out_ptr.dtype.element_ty), mask=ok)


def tree_conv1d_triton(xBC, conv_state, weight, bias, parents, *, out=None, is_chain=False):
    """Triton ``tree_conv1d_ref``: ``silu(conv)`` ``[B, N, C]`` in ``xBC``'s dtype; ``conv_state`` is read only."""
    if xBC.dim() != 3:
        raise ValueError(f"tree_conv1d: xBC must be [B, N, C], got {tuple(xBC.shape)}")
    b, n, c = xBC.shape
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"tree_conv1d: weight {tuple(weight.shape)} must be [{c}, K]")
    width = weight.shape[1]
    if conv_state.shape != (b, c, width - 1):
        raise ValueError(f"tree_conv1d: conv_state {tuple(conv_state.shape)} must be [{b}, {c}, {width - 1}]")
    if not is_chain and parents.shape != (b, n):
        raise ValueError(f"tree_conv1d: parents {tuple(parents.shape)} must be [{b}, {n}]")
    out = torch.empty_like(xBC) if out is None else out
    if out.shape != xBC.shape:
        raise ValueError(f"tree_conv1d: out {tuple(out.shape)} must match xBC {tuple(xBC.shape)}")
    block_n = min(32, max(16, triton.next_power_of_2(n)))
    block_c = 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(c, block_c), b)
    par_strides = parents.stride() if parents is not None and parents.dim() == 2 else (0, 0)
    _tree_conv_kernel[grid](
        xBC, conv_state, weight, bias if bias is not None else weight, parents if parents is not None else xBC, out,
        n, c, *xBC.stride(), *conv_state.stride(), *weight.stride(), *par_strides, *out.stride(),
        K=width, HAS_BIAS=bias is not None, IS_CHAIN=is_chain, BLOCK_N=block_n, BLOCK_C=block_c,
        num_warps=4,
    )
    return out
