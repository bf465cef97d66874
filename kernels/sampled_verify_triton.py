"""Sampled tree verification in one Triton launch: one program per sequence walks its tree.

The program holds the tree in registers (as the greedy kernel does) and streams the vocabulary in blocks: the
target's law at the current node stays implicit (softmax statistics of its logits row, one pass) until a
rejection turns it into a residual in a per-row scratch row; the bonus token is drawn by inverse CDF in two
passes. Greedy rows (temperature 0) take the greedy kernel's rule in the same launch, instead of a few hundred
small PyTorch launches per step at T > 0.
The reference (``sampled_verify.sampled_verify_ref``) defines the law. Top-k / top-p arrive as logits already
filtered to ``-inf`` (``protocols.sampling.filter_logits_rows``, called by ``ops.sampled_verify``): the kernel
itself only knows temperature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.greedy_verify_triton import (
    check_tree_args,
    greedy_final_tl,
    tree_blocks,
    tree_structure_tl,
    verify_outputs,
    write_path_tl,
)
from stree.protocols.token_tree import DraftMode

MODE_CODES = {DraftMode.DETERMINISTIC: 0, DraftMode.IID: 1, DraftMode.WITHOUT_REPLACEMENT: 2}
MAX_BLOCK = 4096
"""Vocabulary entries one program handles per loop iteration."""


@triton.jit
def _p_block(offs, m, mat, p_row, l_row, temp, M, S):
    """The current law on ``offs``: the residual in scratch (``mat``), else softmax(logits / temp)."""
    if mat != 0:
        v = tl.load(p_row + offs, mask=m, other=0.0)
    else:
        x = tl.load(l_row + offs, mask=m, other=float("-inf")).to(tl.float32)
        v = tl.where(m, tl.exp(x / temp - M) / S, 0.0)
    return v


@triton.jit
def _p_at(x, mat, p_row, l_row, temp, M, S):
    if mat != 0:
        v = tl.load(p_row + x)
    else:
        v = tl.exp(tl.load(l_row + x).to(tl.float32) / temp - M) / S
    return v


@triton.jit
def _q_block(offs, m, x, qmat, q_row, qs_row, QS, MODE: tl.constexpr):
    """The draft law on ``offs``: a point mass at x, the normalized draft row, or its scratch copy (``qmat``)."""
    if MODE == 0:
        v = tl.where(offs == x, 1.0, 0.0)
    else:
        if qmat != 0:
            v = tl.load(qs_row + offs, mask=m, other=0.0)
        else:
            v = tl.load(q_row + offs, mask=m, other=0.0).to(tl.float32)
            v = tl.where(QS > 0, v / tl.where(QS > 0, QS, 1.0), v)
    return v


@triton.jit
def _q_at(x, qmat, q_row, qs_row, QS, MODE: tl.constexpr):
    if MODE == 0:
        v = QS * 0.0 + 1.0
    else:
        if qmat != 0:
            v = tl.load(qs_row + x)
        else:
            v = tl.load(q_row + x).to(tl.float32)
            v = tl.where(QS > 0, v / tl.where(QS > 0, QS, 1.0), v)
    return v


@triton.jit
def _softmax_stats(l_row, V, temp, BV: tl.constexpr):
    """Max and normalizer of softmax(logits / temp) over one row, online per lane."""
    lanes = tl.arange(0, BV)
    mv = tl.full([BV], -3.0e38, tl.float32)
    sv = tl.zeros([BV], tl.float32)
    for start in range(0, V, BV):
        offs = start + lanes
        x = tl.load(l_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
        new = tl.maximum(mv, x)
        sv = sv * tl.exp(mv - new) + tl.exp(x - new)
        mv = new
    M = tl.max(mv, 0)
    return M, tl.sum(sv * tl.exp(mv - M), 0)


@triton.jit
def _row_sum(q_row, V, BV: tl.constexpr):
    lanes = tl.arange(0, BV)
    acc = tl.zeros([BV], tl.float32)
    for start in range(0, V, BV):
        offs = start + lanes
        acc += tl.load(q_row + offs, mask=offs < V, other=0.0).to(tl.float32)
    return tl.sum(acc, 0)


@triton.jit
def _reject(V, x, mat, p_row, l_row, temp, M, S, qmat, q_row, qs_row, QS, MODE: tl.constexpr, REMOVE: tl.constexpr,
            BV: tl.constexpr):
    """After rejecting token x: p <- normalize(max(p - q, 0)) unless no mass is left; without replacement, also
    q <- normalize(q without x). Returns the new (mat, qmat) flags."""
    lanes = tl.arange(0, BV)
    acc = tl.zeros([BV], tl.float32)
    for start in range(0, V, BV):
        offs = start + lanes
        m = offs < V
        p = _p_block(offs, m, mat, p_row, l_row, temp, M, S)
        q = _q_block(offs, m, x, qmat, q_row, qs_row, QS, MODE)
        acc += tl.maximum(p - q, 0.0)
    tot = tl.sum(acc, 0)
    if tot > 0:
        for start in range(0, V, BV):
            offs = start + lanes
            m = offs < V
            p = _p_block(offs, m, mat, p_row, l_row, temp, M, S)
            q = _q_block(offs, m, x, qmat, q_row, qs_row, QS, MODE)
            tl.store(p_row + offs, tl.maximum(p - q, 0.0) / tot, mask=m)
        mat = mat * 0 + 1
    if MODE == 2 and REMOVE:
        acc = tl.zeros([BV], tl.float32)
        for start in range(0, V, BV):
            offs = start + lanes
            m = offs < V
            q = _q_block(offs, m, x, qmat, q_row, qs_row, QS, MODE)
            acc += tl.where(offs == x, 0.0, q)
        qtot = tl.sum(acc, 0)
        for start in range(0, V, BV):
            offs = start + lanes
            m = offs < V
            q = tl.where(offs == x, 0.0, _q_block(offs, m, x, qmat, q_row, qs_row, QS, MODE))
            tl.store(qs_row + offs, tl.where(qtot > 0, q / tl.where(qtot > 0, qtot, 1.0), q), mask=m)
        qmat = qmat * 0 + 1
    tl.debug_barrier()  # later single-token loads read what other threads wrote
    return mat, qmat


@triton.jit
def _sample(V, u, mat, p_row, l_row, temp, M, S, BV: tl.constexpr):
    """Inverse CDF: the smallest index whose cumulative mass exceeds u * total, never past the last index that
    adds mass (``sampling.sample_inverse_cdf``); both passes build the same blocked cumulative sums."""
    lanes = tl.arange(0, BV)
    carry = M * 0.0
    for start in range(0, V, BV):
        offs = start + lanes
        cdf = carry + tl.cumsum(_p_block(offs, offs < V, mat, p_row, l_row, temp, M, S), 0)
        carry = tl.max(cdf, 0)
    total = carry
    thr = u * total
    carry = M * 0.0
    below = (M * 0.0).to(tl.int32)
    last = below
    for start in range(0, V, BV):
        offs = start + lanes
        m = offs < V
        cdf = carry + tl.cumsum(_p_block(offs, m, mat, p_row, l_row, temp, M, S), 0)
        carry = tl.max(cdf, 0)
        below += tl.sum(((cdf <= thr) & m).to(tl.int32), 0)
        last += tl.sum(((cdf < total) & m).to(tl.int32), 0)
    return tl.minimum(below, last)


@triton.jit
def _sampled_verify_kernel(
    tok_ptr, par_ptr, valid_ptr, best_ptr, logit_ptr, temp_ptr, q_ptr, u_ptr, bu_ptr, p_scr, q_scr,
    path_ptr, plen_ptr, bonus_ptr, out_ptr,
    N, V, MAX_DEPTH, MAX_WIDTH, accept_scale,
    s_tb, s_tn, s_pb, s_pn, s_vb, s_vn, s_bb, s_bn, s_lb, s_ln, s_fb, s_fn, s_ub, s_un, s_wb, s_wn,
    s_qb, s_qd, s_ob, s_od,
    MODE: tl.constexpr, REMOVE: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, LOG2_BN: tl.constexpr,
    BV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    nodes, ok, tok, par, anc, depth, rank, in_bounds = tree_structure_tl(
        tok_ptr, par_ptr, valid_ptr, b, N, MAX_DEPTH, MAX_WIDTH, s_tb, s_tn, s_pb, s_pn, s_vb, s_vn, BN, LOG2_BN)
    final, bonus = greedy_final_tl(best_ptr, b, N, s_bb, s_bn, nodes, ok, tok, par, anc, depth, in_bounds)
    temp = tl.load(temp_ptr + b).to(tl.float32)
    if temp > 0:
        b64 = b.to(tl.int64)
        p_row = p_scr + b64 * V
        qs_row = q_scr + b64 * V
        node = final * 0
        done = node
        mat = node  # 1: the current law is the residual in scratch; 0: softmax of node's logits
        qmat = node  # 1: the draft law is the without-replacement copy in scratch
        M = temp * 0.0
        S = M + 1.0
        QS = S
        for level in range(MAX_DEPTH + 1):
            l_row = logit_ptr + b64 * s_lb + node.to(tl.int64) * s_ln
            if done == 0:
                M, S = _softmax_stats(l_row, V, temp, BV)
                mat = node * 0
            if (done == 0) & (level < MAX_DEPTH):
                q_row = q_ptr + b64 * s_fb + node.to(tl.int64) * s_fn
                qmat = node * 0
                if MODE != 0:
                    QS = _row_sum(q_row, V, BV)
                accepted = node * 0 - 1
                for r in range(MAX_WIDTH):
                    pick = (par == node) & in_bounds & (rank == r) & (nodes > 0)
                    has = tl.sum(pick.to(tl.int32), 0)
                    child = tl.sum(tl.where(pick, nodes, 0), 0)
                    x = tl.sum(tl.where(pick, tok, 0), 0)
                    if (has > 0) & (accepted < 0):
                        q_x = _q_at(x, qmat, q_row, qs_row, QS, MODE)
                        if q_x > 0:  # else q could not have drawn x: skip it
                            p_x = _p_at(x, mat, p_row, l_row, temp, M, S)
                            u = tl.load(u_ptr + b * s_ub + child * s_un).to(tl.float32)
                            if u * q_x < accept_scale * p_x:
                                accepted = child
                            else:
                                mat, qmat = _reject(V, x, mat, p_row, l_row, temp, M, S, qmat, q_row, qs_row, QS,
                                                    MODE, REMOVE, BV)
                if accepted >= 0:
                    node = accepted
                else:
                    done = node * 0 + 1
        l_row = logit_ptr + b64 * s_lb + node.to(tl.int64) * s_ln
        u = tl.load(bu_ptr + b * s_wb + node * s_wn).to(tl.float32)
        bonus = _sample(V, u, mat, p_row, l_row, temp, M, S, BV).to(bonus.dtype)
        final = node
    write_path_tl(final, bonus, b, MAX_DEPTH, nodes, tok, anc, depth, path_ptr, plen_ptr, bonus_ptr, out_ptr,
                  s_qb, s_qd, s_ob, s_od, BD)


def sampled_verify_triton(tokens, parents, valid, logits, temperature, top_k, top_p, mode, draft_probs, uniforms,
                          bonus_uniforms, max_depth: int, max_width: int, prob_dtype: torch.dtype = torch.float32, *,
                          accept_scale: float = 1.0, remove: bool = True):
    """Triton ``sampled_verify_ref`` (same outputs and contract) for float32 laws and trees of at most ``MAX_NODES``
    nodes, with top-k / top-p already applied to ``logits`` (``filter_logits_rows``); anything else raises
    ValueError (``ops`` filters the logits, or routes to the reference). ``accept_scale`` and ``remove`` exist
    for the tests that must catch a biased verifier."""
    if top_k is not None or top_p is not None:
        raise ValueError("sampled_verify: the kernel takes top-k / top-p as filtered logits "
                         "(protocols.sampling.filter_logits_rows), not as parameters")
    if prob_dtype != torch.float32:
        raise ValueError(f"sampled_verify: the kernel walks float32 laws, not {prob_dtype}")
    mode = DraftMode(mode)
    check_tree_args("sampled_verify", tokens, parents, valid, uniforms)
    b, n = tokens.shape
    if bonus_uniforms.shape != (b, n) or tuple(logits.shape[:2]) != (b, n) or temperature.shape != (b,):
        raise ValueError(f"sampled_verify: bonus_uniforms {tuple(bonus_uniforms.shape)}, logits "
                         f"{tuple(logits.shape)}, temperature {tuple(temperature.shape)} do not fit [{b}, {n}]")
    vocab = logits.shape[-1]
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    q = logits if mode is DraftMode.DETERMINISTIC else draft_probs
    q = q if q.stride(-1) == 1 else q.contiguous()
    best = logits.argmax(-1)
    path, path_len, bonus, out = verify_outputs(b, max_depth, tokens.device)
    p_scr = torch.empty(b, vocab, dtype=torch.float32, device=tokens.device)
    q_scr = torch.empty_like(p_scr) if mode is DraftMode.WITHOUT_REPLACEMENT else p_scr
    v = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    bv = min(MAX_BLOCK, max(16, triton.next_power_of_2(vocab)))
    _sampled_verify_kernel[(b,)](
        tokens, parents, v, best, logits, temperature, q, uniforms, bonus_uniforms, p_scr, q_scr,
        path, path_len, bonus, out, n, vocab, max_depth, max_width, float(accept_scale),
        *tokens.stride(), *parents.stride(), *v.stride(), *best.stride(), logits.stride(0), logits.stride(1),
        q.stride(0), q.stride(1), *uniforms.stride(), *bonus_uniforms.stride(), *path.stride(), *out.stride(),
        MODE=MODE_CODES[mode], REMOVE=bool(remove), **tree_blocks(n, max_depth), BV=bv,
        num_warps=8 if bv >= 2048 else 4,
        **pdl.launch_args(),
    )
    return path, path_len, bonus, out
