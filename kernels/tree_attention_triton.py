"""Tree attention over a KV cache and KV compaction, in Triton (one launch each, no host sync).

``tree_attention_triton``: flash-decoding style online softmax; a program owns a block of
(node, query head) rows of one KV head (GQA heads share each K/V load) and one slice of the keys
``[0, seqlen + N)`` (``seqlen`` is read on the device, so cost follows the committed length and the
launch is CUDA-graph safe); a second small launch merges the slices. Committed slots are
visible to every node, tree slot ``seqlen + j`` to node i iff ``anc_mask[i, j]``.
``tree_attention_sdpa`` is the measured alternative (PyTorch SDPA over the whole cache with a
boolean mask). ``kv_commit_triton`` moves the accepted nodes' K/V to contiguous slots.
References: ``tree_attention_ref``, ``kv_commit_ref``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.tree_attention import tree_attention_mask


@triton.jit
def load_query_rows(q_ptr, b, node, head, offs_d, r_ok, d_ok, s_qb, s_qn, s_qh, s_qd):
    """Query rows ``(node, head)`` of sequence ``b`` (``[rows, D]``), zero outside ``r_ok x d_ok``."""
    return tl.load(q_ptr + b * s_qb + node[:, None] * s_qn + head[:, None] * s_qh + offs_d[None, :] * s_qd,
                   mask=r_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def softmax_fold(q, k, v, vis, m_i, l_i, acc, qk_scale, HALF: tl.constexpr):
    """One block of keys ``k`` ``[D, BN]`` and values ``v`` ``[BN, D]``, visible to a row where ``vis``
    ``[rows, BN]``, folded into the online softmax state ``(max, sum, acc)`` (scores in log2 units)."""
    if HALF:
        s = tl.dot(q, k)
    else:
        s = tl.dot(q, k, input_precision="ieee")
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HALF:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attn_block(q, m_i, l_i, acc, j0, limit, sl, k_row, v_row, anc_row, r_ok, offs_d, d_ok,
                s_kl, s_kd, s_vl, s_vd, s_aj, qk_scale,
                BN: tl.constexpr, HALF: tl.constexpr, TREE: tl.constexpr):
    """One block of keys ``[j0, j0 + BN) ∩ [.., limit)`` folded into the online softmax state."""
    cols = j0 + tl.arange(0, BN)
    c_ok = cols < limit
    k = tl.load(k_row + cols[None, :] * s_kl + offs_d[:, None] * s_kd, mask=c_ok[None, :] & d_ok[:, None], other=0.0)
    if TREE:  # tree slots: visible iff the key's node is an ancestor of (or is) the query's node
        anc = tl.load(anc_row + (cols - sl)[None, :] * s_aj, mask=r_ok[:, None] & c_ok[None, :], other=0)
        vis = anc != 0
    else:  # committed slots: visible to every node
        vis = c_ok[None, :] & r_ok[:, None]
    v = tl.load(v_row + cols[:, None] * s_vl + offs_d[None, :] * s_vd, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    return softmax_fold(q, k, v, vis, m_i, l_i, acc, qk_scale, HALF)


@triton.jit
def _tree_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, seqlen_ptr, anc_ptr, o_ptr, po_ptr, pml_ptr,
    N, L, Hkv, D, group, qk_scale, n_splits, min_chunk,
    s_qb, s_qn, s_qh, s_qd,
    s_kb, s_kl, s_kh, s_kd,
    s_vb, s_vl, s_vh, s_vd,
    s_ab, s_ai, s_aj,
    s_ob, s_on, s_oh, s_od,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HALF: tl.constexpr, DIRECT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows are (node, query head) pairs of one KV head (GQA packing); program ``split`` takes one
    slice of the visible keys (slices of at least ``min_chunk`` keys, so short caches use few).
    With one split it writes the output, else partial (acc, max, sum) for the merge."""
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_bk = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    n_rows = N * group
    r = pid_m * BM + tl.arange(0, BM)
    r_ok = r < n_rows
    node = r // group
    head = hk * group + r % group
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = load_query_rows(q_ptr, b, node, head, offs_d, r_ok, d_ok, s_qb, s_qn, s_qh, s_qd)
    sl = tl.load(seqlen_ptr + b).to(tl.int32)
    # Keys past this block's last node are never visible to it.
    last = tl.minimum(N, ((pid_m + 1) * BM - 1) // group + 1)
    end = tl.minimum(sl + last, L)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(end, n_splits), BN) * BN, min_chunk)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)
    k_row = k_ptr + b * s_kb + hk * s_kh
    v_row = v_ptr + b * s_vb + hk * s_vh
    anc_row = anc_ptr + b * s_ab + node[:, None] * s_ai
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    c_hi = tl.minimum(hi, sl)
    for j0 in range(lo, c_hi, BN):
        m_i, l_i, acc = _attn_block(q, m_i, l_i, acc, j0, c_hi, sl, k_row, v_row, anc_row, r_ok, offs_d, d_ok,
                                    s_kl, s_kd, s_vl, s_vd, s_aj, qk_scale, BN, HALF, False)
    for j0 in range(tl.maximum(lo, sl), hi, BN):
        m_i, l_i, acc = _attn_block(q, m_i, l_i, acc, j0, hi, sl, k_row, v_row, anc_row, r_ok, offs_d, d_ok,
                                    s_kl, s_kd, s_vl, s_vd, s_aj, qk_scale, BN, HALF, True)
    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + b * s_ob + node[:, None] * s_on + head[:, None] * s_oh + offs_d[None, :] * s_od,
                 out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
    else:
        base = (pid_bk * n_splits + split) * n_rows
        # An empty slice writes only (max=-inf, sum=0); the merge then never reads its acc.
        r_lim = tl.where(lo < end, n_rows, 0)
        tl.store(po_ptr + (base + r)[:, None] * BD + offs_d[None, :], acc, mask=(r < r_lim)[:, None])
        tl.store(pml_ptr + 2 * (base + r), m_i, mask=r_ok)
        tl.store(pml_ptr + 2 * (base + r) + 1, l_i, mask=r_ok)


@triton.jit
def _tree_attn_combine_kernel(
    o_ptr, po_ptr, pml_ptr, N, Hkv, D, group, n_splits,
    s_ob, s_on, s_oh, s_od,
    SP: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the splits' partial softmax sums of one (node, query head) row, all splits at once."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    n_rows = N * group
    sp = tl.arange(0, SP)
    sp_ok = sp < n_splits
    idx = (pid_bk * n_splits + sp) * n_rows + r
    m = tl.load(pml_ptr + 2 * idx, mask=sp_ok, other=float("-inf"))
    l = tl.load(pml_ptr + 2 * idx + 1, mask=sp_ok, other=0.0)
    live = sp_ok & (m > float("-inf"))
    m_max = tl.max(m, 0)
    w = tl.where(live, tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)), 0.0)
    offs_d = tl.arange(0, BD)
    part = tl.load(po_ptr + idx[:, None] * BD + offs_d[None, :], mask=live[:, None], other=0.0)
    l_tot = tl.sum(l * w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(o_ptr + b * s_ob + (r // group) * s_on + (hk * group + r % group) * s_oh + offs_d * s_od,
             out.to(o_ptr.dtype.element_ty), mask=offs_d < D)


MIN_CHUNK = 64
"""Fewest keys per split slice (on the device, from ``seqlen``): short caches use few slices. One key block (64):
a one-token decode over a few hundred keys then runs a block per program in parallel rather than several blocks one
after another in each of a few programs."""
SMALL_ROWS = 16
"""Row blocks of at most this many (node, query head) rows take a 16-row tile, the smallest ``tl.dot`` takes: a
decode step has one row per KV head, which the 32/64-row tile computed 32-64 times over."""


def block_rows(rows: int, half: bool) -> int:
    """The row tile: 16 for few rows (decode, small trees), else 64 in half precision and 32 in fp32."""
    return 16 if rows <= SMALL_ROWS else (64 if half else 32)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_attention(q, k_cache, v_cache, seqlen, anc_mask):
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} must be [B, N, Hq, D] and k/v caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} [B, L, Hkv, D]")
    b, n, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or hq % k_cache.shape[2]:
        raise ValueError(f"tree_attention: caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)}")
    if seqlen.shape != (b,) or anc_mask.shape != (b, n, n):
        raise ValueError(f"tree_attention: seqlen {tuple(seqlen.shape)} / anc_mask {tuple(anc_mask.shape)} "
                         f"must be [{b}] / [{b}, {n}, {n}]")


def tree_attention_triton(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale=None, *, out=None,
                          num_splits=None, min_chunk=None, block_m=None):
    """Triton ``tree_attention_ref``: ``[B, N, Hq, D]`` in ``q``'s dtype; reads keys up to ``seqlen + N``.

    Keys are split over ``num_splits`` programs per row block (default: enough to fill the GPU, from
    the cache size, never from ``seqlen``, so the launch shape is graph-stable); on the device each
    slice gets at least ``min_chunk`` keys (default ``MIN_CHUNK``), so a short cache uses few. >1 split adds a
    merge launch. ``block_m``: rows per program (default ``block_rows``).
    """
    _check_attention(q, k_cache, v_cache, seqlen, anc_mask)
    b, n, hq, d = q.shape
    L, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    anc = anc_mask.view(torch.uint8) if anc_mask.dtype == torch.bool else anc_mask
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape:
        raise ValueError(f"tree_attention: out {tuple(out.shape)} must match q {tuple(q.shape)}")
    half = q.dtype in (torch.float16, torch.bfloat16)
    bd = max(16, triton.next_power_of_2(d))
    rows = n * group
    bm = block_m or block_rows(rows, half)
    bn = 64 if bd <= 128 else 32
    row_blocks = triton.cdiv(rows, bm)
    min_chunk = MIN_CHUNK if min_chunk is None else min_chunk
    if num_splits is None:
        sms = _sm_count(q.device.index or 0) if q.is_cuda else 4
        num_splits = max(1, min(triton.cdiv(2 * sms, row_blocks * b * hkv), triton.cdiv(L, max(min_chunk, bn)), 64))
    direct = num_splits == 1
    if direct:
        po = pml = out  # unused
    else:
        po = torch.empty(b * hkv * num_splits * rows, bd, dtype=torch.float32, device=q.device)
        pml = torch.empty(b * hkv * num_splits * rows * 2, dtype=torch.float32, device=q.device)
    nw = 8 if bd * bm >= 64 * 128 else 4
    _tree_attn_split_kernel[(row_blocks, b * hkv, num_splits)](
        q, k_cache, v_cache, seqlen, anc, out, po, pml,
        n, L, hkv, d, group, scale * 1.4426950408889634, num_splits, min_chunk,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *anc.stride(), *out.stride(),
        BM=bm, BN=bn, BD=bd, HALF=half, DIRECT=direct, num_warps=nw,
        **pdl.launch_args(),
    )
    if not direct:
        _tree_attn_combine_kernel[(rows, b * hkv)](
            out, po, pml, n, hkv, d, group, num_splits, *out.stride(),
            SP=max(2, triton.next_power_of_2(num_splits)), BD=bd, num_warps=4,
            **pdl.launch_args(),
        )
    return out


def tree_attention_sdpa(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale=None):
    """The same attention through PyTorch SDPA with a boolean mask over the whole cache (graph-safe)."""
    _check_attention(q, k_cache, v_cache, seqlen, anc_mask)
    L = k_cache.shape[1]
    mask = tree_attention_mask(seqlen, anc_mask, L)[:, None]  # [B, 1, N, L]
    rep = q.shape[2] // k_cache.shape[2]
    k, v = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2)


@triton.jit
def _kv_commit_kernel(
    k_ptr, v_ptr, seqlen_ptr, path_ptr, plen_ptr, W,
    s_kb, s_kl, s_vb, s_vl, s_pb, s_pm,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(1)
    offs_w = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs_w < W
    m = tl.arange(0, BLOCK_M)
    plen = tl.load(plen_ptr + b).to(tl.int32)
    m_ok = m < plen
    sl = tl.load(seqlen_ptr + b)
    src = sl + tl.load(path_ptr + b * s_pb + m * s_pm, mask=m_ok, other=0)
    dst = sl + m
    mask = m_ok[:, None] & w_ok[None, :]
    kk = tl.load(k_ptr + b * s_kb + src[:, None] * s_kl + offs_w[None, :], mask=mask)
    vv = tl.load(v_ptr + b * s_vb + src[:, None] * s_vl + offs_w[None, :], mask=mask)
    tl.debug_barrier()  # every source row is read before any destination row is written
    tl.store(k_ptr + b * s_kb + dst[:, None] * s_kl + offs_w[None, :], kk, mask=mask)
    tl.store(v_ptr + b * s_vb + dst[:, None] * s_vl + offs_w[None, :], vv, mask=mask)


def kv_commit_triton(k_cache, v_cache, seqlen, path, path_len):
    """Triton ``kv_commit_ref``: slot ``seqlen + path[m]`` -> ``seqlen + m`` for ``m < path_len``, in place."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"kv_commit: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must be equal [B, L, Hkv, D]")
    b = k_cache.shape[0]
    if path.dim() != 2 or path.shape[0] != b or path_len.shape != (b,) or seqlen.shape != (b,):
        raise ValueError(f"kv_commit: path {tuple(path.shape)}, path_len {tuple(path_len.shape)}, seqlen "
                         f"{tuple(seqlen.shape)} must be [{b}, M], [{b}], [{b}]")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != k_cache.shape[3] or v_cache.stride() != k_cache.stride():
        raise ValueError("kv_commit: the K/V caches must be contiguous in their last two dimensions")
    width = k_cache.shape[2] * k_cache.shape[3]
    block_m = max(16, triton.next_power_of_2(path.shape[1]))
    block_w = max(16, min(triton.next_power_of_2(width), 8192 // block_m))
    grid = (triton.cdiv(width, block_w), b)
    _kv_commit_kernel[grid](
        k_cache, v_cache, seqlen, path, path_len, width,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), *path.stride(),
        BLOCK_M=block_m, BLOCK_W=block_w, num_warps=4,
        **pdl.launch_args(),
    )
