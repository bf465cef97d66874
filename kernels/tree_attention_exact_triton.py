"""Tree attention of the exact numerics in Triton: logical key order, a fixed split size over keys, splits merged
in order (reference: ``tree_attention_exact.tree_attention_exact_ref``).

Rows of a program are the query heads of one KV head (GQA heads share each K/V load), for ONE tree node, or, over
a chain (prefill, decode steps, chain trees), for consecutive nodes, which all see the keys ``0 .. seqlen + i``
in cache order. A node's logical key ``seqlen + m`` is its ancestor at depth m (found from its ancestor-mask row),
so a tree node reads exactly the keys a decode step at its position reads, in the same blocks of ``BLOCK_N``.
Keys are cut into slices of ``KEY_SPLIT`` logical keys from key 0; each slice's online softmax (``acc``, max,
sum) is stored, and a second launch merges a row's slices in slice order. How many programs share the slices
(enough to fill the GPU) changes no bit; the row tile (``block_rows``) and key block are fixed per model. A cache
of at most ``KEY_SPLIT`` slots has one slice, written directly, which the merge of one slice reproduces exactly.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.gemm_triton import _sms
from stree.kernels.pdl import pdl_enter
from stree.kernels.tree_attention_exact import KEY_SPLIT
from stree.kernels.tree_attention_triton import _check_attention, load_query_rows, softmax_fold


@triton.jit(do_not_specialize=["N", "nodes_per_program", "split_programs"])
def _exact_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, seqlen_ptr, anc_ptr, o_ptr, po_ptr, pml_ptr,
    N, L, Hkv, D, group, qk_scale, split_programs, n_splits, nodes_per_program,
    s_qb, s_qn, s_qh, s_qd, s_kb, s_kl, s_kh, s_kd, s_vb, s_vl, s_vh, s_vd, s_ab, s_ai, s_aj,
    s_ob, s_on, s_oh, s_od,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr,
    HALF: tl.constexpr, IS_CHAIN: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    r = tl.arange(0, BM)
    node = pid_n * nodes_per_program + r // group
    r_ok = (r < nodes_per_program * group) & (node < N)
    head = hk * group + r % group
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = load_query_rows(q_ptr, b, node, head, offs_d, r_ok, d_ok, s_qb, s_qn, s_qh, s_qd)
    sl = tl.load(seqlen_ptr + b).to(tl.int32)
    offs_j = tl.arange(0, NP)
    if IS_CHAIN:
        count = sl + node + 1
    else:  # one node per program: its ancestors, and each one's depth (its rank among them)
        anc = tl.load(anc_ptr + b * s_ab + pid_n * s_ai + offs_j * s_aj, mask=offs_j < N, other=0) != 0
        rank = tl.cumsum(anc.to(tl.int32), 0) - 1
        count = sl + tl.sum(anc.to(tl.int32), 0) + node * 0
    count = tl.where(r_ok, count, 0)
    total = tl.max(count, 0)
    k_row = k_ptr + b * s_kb + hk * s_kh
    v_row = v_ptr + b * s_vb + hk * s_vh
    rows = (pid_bk * N + node) * group + r % group  # a row's index among every (sequence, KV head, node, head)
    for split in range(tl.program_id(2), tl.cdiv(total, SPLIT), split_programs):
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, total)
        for j0 in range(lo, hi, BN):
            cols = j0 + tl.arange(0, BN)  # logical keys
            slot = cols
            if not IS_CHAIN:
                if j0 + BN > sl:  # tree keys: logical key sl + m is the ancestor at depth m
                    rel = cols - sl
                    up = tl.sum(tl.where(anc[None, :] & (rank[None, :] == rel[:, None]), offs_j[None, :], 0), 1)
                    slot = tl.where(rel < 0, cols, sl + up)
            c_ok = (cols < hi) & (slot < L)
            k = tl.load(k_row + slot[None, :] * s_kl + offs_d[:, None] * s_kd, mask=c_ok[None, :] & d_ok[:, None],
                        other=0.0)
            v = tl.load(v_row + slot[:, None] * s_vl + offs_d[None, :] * s_vd, mask=c_ok[:, None] & d_ok[None, :],
                        other=0.0)
            vis = c_ok[None, :] & (cols[None, :] < count[:, None])
            m_i, l_i, acc = softmax_fold(q, k, v, vis, m_i, l_i, acc, qk_scale, HALF)
        if DIRECT:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(o_ptr + b * s_ob + node[:, None] * s_on + head[:, None] * s_oh + offs_d[None, :] * s_od,
                     out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
        else:
            part = rows * n_splits + split
            tl.store(po_ptr + part[:, None] * BD + offs_d[None, :], acc, mask=r_ok[:, None])
            tl.store(pml_ptr + 2 * part, m_i, mask=r_ok)
            tl.store(pml_ptr + 2 * part + 1, l_i, mask=r_ok)


@triton.jit(do_not_specialize=["N"])
def _exact_attn_merge_kernel(
    o_ptr, po_ptr, pml_ptr, seqlen_ptr, anc_ptr, N, Hkv, D, group, n_splits,
    s_ob, s_on, s_oh, s_od, s_ab, s_ai, s_aj,
    BD: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr, IS_CHAIN: tl.constexpr, PDL: tl.constexpr,
):
    """One row's slices merged in slice order: the max over them, then ``sum_s acc_s w_s / sum_s l_s w_s``."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b = pid_bk // Hkv
    hk = pid_bk % Hkv
    node = r // group
    sl = tl.load(seqlen_ptr + b).to(tl.int32)
    offs_j = tl.arange(0, NP)
    if IS_CHAIN:
        count = sl + node + 1
    else:
        anc = tl.load(anc_ptr + b * s_ab + node * s_ai + offs_j * s_aj, mask=offs_j < N, other=0) != 0
        count = sl + tl.sum(anc.to(tl.int32), 0)
    live = tl.cdiv(count, SPLIT)
    base = (pid_bk * N * group + r) * n_splits
    m_max = tl.load(pml_ptr + 2 * base)
    for s in range(1, live):
        m_max = tl.maximum(m_max, tl.load(pml_ptr + 2 * (base + s)))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    offs_d = tl.arange(0, BD)
    w = tl.exp2(tl.load(pml_ptr + 2 * base) - m_safe)
    out = tl.load(po_ptr + base * BD + offs_d) * w
    l_tot = tl.load(pml_ptr + 2 * base + 1) * w
    for s in range(1, live):
        w = tl.exp2(tl.load(pml_ptr + 2 * (base + s)) - m_safe)
        out += tl.load(po_ptr + (base + s) * BD + offs_d) * w
        l_tot += tl.load(pml_ptr + 2 * (base + s) + 1) * w
    out = out / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(o_ptr + b * s_ob + node * s_on + (hk * group + r % group) * s_oh + offs_d * s_od,
             out.to(o_ptr.dtype.element_ty), mask=offs_d < D)


def block_rows(group: int) -> int:
    """Rows per program: the query heads of one KV head, at least 16 (the smallest ``tl.dot`` tile). Fixed per
    model, so every row count meets the same tile."""
    return max(16, triton.next_power_of_2(group))


def tree_attention_exact_triton(q, k_cache, v_cache, seqlen, anc_mask, softmax_scale=None, is_chain: bool = False,
                                *, out=None, split_programs=None):
    """Triton ``tree_attention_exact_ref``: ``[B, N, Hq, D]`` in ``q``'s dtype. ``is_chain``: ``anc_mask`` is
    lower-triangular (prefill, decode steps, chain trees), so several nodes share a program's key loads.
    ``split_programs`` (default: enough to fill the GPU) programs share each row block's slices."""
    _check_attention(q, k_cache, v_cache, seqlen, anc_mask)
    b, n, hq, d = q.shape
    cap, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape:
        raise ValueError(f"tree_attention: out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if b == 0 or n == 0:
        return out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    anc = anc_mask.view(torch.uint8) if anc_mask.dtype == torch.bool else anc_mask
    half = q.dtype in (torch.float16, torch.bfloat16)
    bd = max(16, triton.next_power_of_2(d))
    bm = block_rows(group)
    bn = 64 if bd <= 128 else 32
    per_program = bm // group if is_chain else 1
    row_blocks = triton.cdiv(n, per_program)
    n_splits = triton.cdiv(cap, KEY_SPLIT)
    direct = n_splits == 1
    if split_programs is None:
        split_programs = max(1, min(n_splits, triton.cdiv(2 * _sms(q.device), row_blocks * b * hkv)))
    if direct:
        po = pml = out  # unused
    else:
        rows = b * hkv * n * group
        po = torch.empty(rows * n_splits, bd, dtype=torch.float32, device=q.device)
        pml = torch.empty(rows * n_splits * 2, dtype=torch.float32, device=q.device)
    np_ = max(2, triton.next_power_of_2(n))
    _exact_attn_split_kernel[(row_blocks, b * hkv, split_programs)](
        q, k_cache, v_cache, seqlen, anc, out, po, pml,
        n, cap, hkv, d, group, scale * 1.4426950408889634, split_programs, n_splits, per_program,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *anc.stride(), *out.stride(),
        BM=bm, BN=bn, BD=bd, NP=np_, SPLIT=KEY_SPLIT, HALF=half, IS_CHAIN=is_chain, DIRECT=direct,
        num_warps=8 if bd * bm >= 64 * 128 else 4, enable_fp_fusion=False, **pdl.launch_args(q.device),
    )
    if not direct:
        _exact_attn_merge_kernel[(n * group, b * hkv)](
            out, po, pml, seqlen, anc, n, hkv, d, group, n_splits, *out.stride(), *anc.stride(),
            BD=bd, NP=np_, SPLIT=KEY_SPLIT, IS_CHAIN=is_chain, num_warps=4, enable_fp_fusion=False,
            **pdl.launch_args(q.device),
        )
    return out
