"""Greedy tree verification in one Triton launch: one program per sequence holds its whole tree.

From the target's argmax after each node it builds the ancestor mask (boolean squaring on the tensor
cores, as the tree scan does), depths and sibling ranks, finds the deepest node whose path follows the
argmax, and writes the accepted path, its length, the bonus token and the emitted tokens: the work
of about seventy small PyTorch launches. Reference: ``greedy_verify.greedy_verify_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.greedy_verify import FUSED_MAX_NODES as MAX_NODES


@triton.jit
def tree_structure_tl(tok_ptr, par_ptr, valid_ptr, b, N, MAX_DEPTH, MAX_WIDTH, s_tb, s_tn, s_pb, s_pn, s_vb, s_vn,
                      BN: tl.constexpr, LOG2_BN: tl.constexpr):
    """One row's tree in registers: node ids, tokens, parents, ancestor mask [BN, BN], depths, and which nodes are
    in bounds (valid, depth <= MAX_DEPTH, sibling rank < MAX_WIDTH); the rank too. As ``greedy_verify.tree_structure``."""
    nodes = tl.arange(0, BN)
    ok = nodes < N
    par = tl.load(par_ptr + b * s_pb + nodes * s_pn, mask=ok, other=-1).to(tl.int32)
    par = tl.where(par < nodes, par, -1)  # a parent must come earlier
    valid = (tl.load(valid_ptr + b * s_vb + nodes * s_vn, mask=ok, other=0) != 0) & ok
    tok = tl.load(tok_ptr + b * s_tb + nodes * s_tn, mask=ok, other=-1)
    anc = ((par[:, None] == nodes[None, :]) | (nodes[:, None] == nodes[None, :])) & ok[:, None]
    for _ in tl.static_range(LOG2_BN):
        r = anc.to(tl.float16)
        anc = tl.dot(r, r) > 0.5
    depth = tl.sum(anc.to(tl.int32), 1) - 1
    parc = tl.maximum(par, 0)
    sib = ((parc[:, None] == parc[None, :]) & (nodes[None, :] < nodes[:, None])
           & (valid & (nodes > 0))[None, :])
    rank = tl.sum(sib.to(tl.int32), 1)
    in_bounds = valid & (depth <= MAX_DEPTH) & (rank < MAX_WIDTH)
    return nodes, ok, tok, par, anc, depth, rank, in_bounds


@triton.jit
def greedy_final_tl(best_ptr, b, N, s_bb, s_bn, nodes, ok, tok, par, anc, depth, in_bounds):
    """The deepest node whose path follows the argmax after each node (lowest index on ties), and the argmax
    after it (the bonus)."""
    best = tl.load(best_ptr + b * s_bb + nodes * s_bn, mask=ok, other=0)
    best_par = tl.load(best_ptr + b * s_bb + tl.maximum(par, 0) * s_bn, mask=ok, other=-2)
    match = (in_bounds & (tok == best_par)) | (nodes == 0)
    bad = tl.sum((anc & ~match[None, :]).to(tl.int32), 1)
    key = tl.where((bad == 0) & ok, depth * N + (N - 1 - nodes), -1)
    final = tl.argmax(key, 0)
    return final, tl.sum(tl.where(nodes == final, best, 0), 0)


@triton.jit
def write_path_tl(final, bonus, b, MAX_DEPTH, nodes, tok, anc, depth, path_ptr, plen_ptr, bonus_ptr, out_ptr,
                  s_qb, s_qd, s_ob, s_od, BD: tl.constexpr):
    """Write the accepted path to ``final`` (node ids by depth), its length, the bonus and the emitted tokens."""
    sel = nodes == final
    on = tl.sum(tl.where(sel[:, None], anc.to(tl.int32), 0), 0) > 0  # final's ancestors and itself
    fdepth = tl.sum(tl.where(sel, depth, 0), 0)
    levels = tl.arange(0, BD)
    path = tl.sum(tl.where(on[None, :] & (depth[None, :] == levels[:, None]), nodes[None, :], 0), 1)
    nxt = tl.sum(tl.where(on[None, :] & (depth[None, :] == levels[:, None] + 1), tok[None, :], 0), 1)
    out = tl.where(levels < fdepth, nxt, tl.where(levels == fdepth, bonus, 0))
    keep = levels <= MAX_DEPTH
    tl.store(path_ptr + b * s_qb + levels * s_qd, path.to(path_ptr.dtype.element_ty), mask=keep)
    tl.store(out_ptr + b * s_ob + levels * s_od, out.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(plen_ptr + b, (fdepth + 1).to(plen_ptr.dtype.element_ty))
    tl.store(bonus_ptr + b, bonus.to(bonus_ptr.dtype.element_ty))


@triton.jit
def _greedy_verify_kernel(
    tok_ptr, par_ptr, valid_ptr, best_ptr, path_ptr, plen_ptr, bonus_ptr, out_ptr,
    N, MAX_DEPTH, MAX_WIDTH,
    s_tb, s_tn, s_pb, s_pn, s_vb, s_vn, s_bb, s_bn, s_qb, s_qd, s_ob, s_od,
    BN: tl.constexpr, BD: tl.constexpr, LOG2_BN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    nodes, ok, tok, par, anc, depth, rank, in_bounds = tree_structure_tl(
        tok_ptr, par_ptr, valid_ptr, b, N, MAX_DEPTH, MAX_WIDTH, s_tb, s_tn, s_pb, s_pn, s_vb, s_vn, BN, LOG2_BN)
    final, bonus = greedy_final_tl(best_ptr, b, N, s_bb, s_bn, nodes, ok, tok, par, anc, depth, in_bounds)
    write_path_tl(final, bonus, b, MAX_DEPTH, nodes, tok, anc, depth, path_ptr, plen_ptr, bonus_ptr, out_ptr,
                  s_qb, s_qd, s_ob, s_od, BD)


def check_tree_args(name, tokens, parents, valid, best):
    """Shapes a one-program verification kernel needs: [B, N] everywhere, N at most ``MAX_NODES``."""
    b, n = tokens.shape
    if n > MAX_NODES:
        raise ValueError(f"{name}: {n} nodes is over the one-program limit of {MAX_NODES}")
    if parents.shape != (b, n) or valid.shape != (b, n) or best.shape != (b, n):
        raise ValueError(f"{name}: parents {tuple(parents.shape)}, valid {tuple(valid.shape)}, best "
                         f"{tuple(best.shape)} must be [{b}, {n}]")


def tree_blocks(n: int, max_depth: int) -> dict:
    """The constexpr block sizes for a tree of ``n`` nodes verified to ``max_depth``."""
    bn = max(16, triton.next_power_of_2(n))
    return dict(BN=bn, BD=max(2, triton.next_power_of_2(max_depth + 1)), LOG2_BN=bn.bit_length() - 1)


def verify_outputs(b: int, max_depth: int, device):
    """Empty ``(path, path_len, bonus, out_tokens)`` for B rows."""
    return (torch.empty(b, max_depth + 1, dtype=torch.long, device=device), torch.empty(b, dtype=torch.long, device=device),
            torch.empty(b, dtype=torch.long, device=device),
            torch.empty(b, max_depth + 1, dtype=torch.long, device=device))


def greedy_verify_triton(tokens, parents, valid, best, max_depth: int, max_width: int):
    """Triton ``greedy_verify_ref`` for trees of at most ``MAX_NODES`` nodes (same outputs, same contract)."""
    check_tree_args("greedy_verify", tokens, parents, valid, best)
    b, n = tokens.shape
    path, path_len, bonus, out = verify_outputs(b, max_depth, tokens.device)
    v = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    _greedy_verify_kernel[(b,)](
        tokens, parents, v, best, path, path_len, bonus, out, n, max_depth, max_width,
        *tokens.stride(), *parents.stride(), *v.stride(), *best.stride(), *path.stride(), *out.stride(),
        **tree_blocks(n, max_depth), num_warps=4,
        **pdl.launch_args(),
    )
    return path, path_len, bonus, out
