"""Activation replay in one Triton launch: new SSM and conv states along each accepted path, in place.

The grid's second axis runs over layers: ``replay_layers_triton`` commits every Mamba2 layer of a model in
one launch when their states and activations are stacked ``[L, ...]`` views (``layer_stack``). Along the
first axis, programs ``[0, n_ssm)`` each own a (sequence, head, headdim block, d_state block) tile of the SSM state and fold
the path in chunks: ``H <- exp(s_tot) H + sum_m exp(s_tot - s_m) dt_m x_m B_m^T`` (one fp32 product
per chunk). The remaining programs each own a channel block of the conv state and copy in the
last ``K-1`` pre-conv rows. Work follows ``path_len`` (read on the device), not the tree size.
Reference: ``replay_ref``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from stree.kernels import pdl
from stree.kernels.pdl import pdl_enter
from stree.kernels.recurrence_triton import carry, ssm_update


@triton.jit
def _replay_kernel(
    h_ptr, cs_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, xbc_ptr, path_ptr, plen_ptr,
    H, P, S, C, M, heads_per_group, n_pblocks, n_sblocks, n_ssm, n_cblocks,
    s_hl, s_sl, s_xl, s_dl, s_al, s_Bl, s_cl,
    s_hb, s_hh, s_hp, s_hs,
    s_sb, s_sc, s_sk,
    s_xb, s_xn, s_xh, s_xp,
    s_db, s_dn, s_dh,
    s_Bb, s_Bn, s_Bg, s_Bs,
    s_cb, s_cn, s_cc,
    s_pb, s_pm,
    KM1: tl.constexpr, KM1_P2: tl.constexpr, DO_SSM: tl.constexpr, DO_CONV: tl.constexpr,
    PATH_IS_ARANGE: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)  # int64: a whole model's stacked state passes 2**31 elements
    h_ptr += layer * s_hl
    cs_ptr += layer * s_sl
    x_ptr += layer * s_xl
    dt_ptr += layer * s_dl
    A_ptr += layer * s_al
    B_ptr += layer * s_Bl
    xbc_ptr += layer * s_cl
    if pid < n_ssm:
        if DO_SSM:
            bh = pid // (n_pblocks * n_sblocks)
            pb = (pid // n_sblocks) % n_pblocks
            sb = pid % n_sblocks
            b = bh // H
            h = bh % H
            g = h // heads_per_group
            offs_p = pb * BP + tl.arange(0, BP)
            offs_s = sb * BS + tl.arange(0, BS)
            p_ok = offs_p < P
            s_ok = offs_s < S
            A_h = tl.load(A_ptr + h).to(tl.float32)
            st_ptrs = h_ptr + b * s_hb + h * s_hh + offs_p[:, None] * s_hp + offs_s[None, :] * s_hs
            st_mask = p_ok[:, None] & s_ok[None, :]
            state = tl.load(st_ptrs, mask=st_mask, other=0.0).to(tl.float32)
            plen = tl.load(plen_ptr + b).to(tl.int32)
            if EXACT:  # the decode step's recurrence, one accepted node after another
                for step in range(0, plen):
                    if PATH_IS_ARANGE:
                        node = step
                    else:
                        node = tl.load(path_ptr + b * s_pb + step * s_pm)
                    xv = tl.load(x_ptr + b * s_xb + node * s_xn + h * s_xh + offs_p * s_xp, mask=p_ok,
                                 other=0.0).to(tl.float32)
                    bv = tl.load(B_ptr + b * s_Bb + node * s_Bn + g * s_Bg + offs_s * s_Bs, mask=s_ok,
                                 other=0.0).to(tl.float32)
                    dtv = tl.load(dt_ptr + b * s_db + node * s_dn + h * s_dh).to(tl.float32)
                    state = carry(ssm_update(state, dtv, A_h, xv, bv), h_ptr.dtype.element_ty)
            else:
                # Loop over the path buffer's width M (not plen) so the node loads need not wait for plen.
                for m0 in range(0, M, BLOCK_M):
                    offs_m = m0 + tl.arange(0, BLOCK_M)
                    if PATH_IS_ARANGE:
                        node = offs_m
                    else:
                        node = tl.load(path_ptr + b * s_pb + offs_m * s_pm, mask=offs_m < M, other=0)
                    m_ok = offs_m < plen
                    dt = tl.load(dt_ptr + b * s_db + node * s_dn + h * s_dh, mask=offs_m < M,
                                 other=0.0).to(tl.float32)
                    dt = tl.where(m_ok, dt, 0.0)
                    s = tl.cumsum(dt * A_h, 0)
                    total = tl.sum(dt * A_h, 0)
                    wgt = tl.where(m_ok, tl.exp(total - s) * dt, 0.0)
                    xs = tl.load(x_ptr + b * s_xb + node[None, :] * s_xn + h * s_xh + offs_p[:, None] * s_xp,
                                 mask=(offs_m < M)[None, :] & p_ok[:, None], other=0.0).to(tl.float32)  # [BP, M]
                    bs = tl.load(B_ptr + b * s_Bb + node[:, None] * s_Bn + g * s_Bg + offs_s[None, :] * s_Bs,
                                 mask=(offs_m < M)[:, None] & s_ok[None, :], other=0.0).to(tl.float32)  # [M, BS]
                    state = tl.exp(total) * state + tl.dot(xs * wgt[None, :], bs, input_precision="ieee")
            tl.store(st_ptrs, state.to(h_ptr.dtype.element_ty), mask=st_mask)
    else:
        if DO_CONV:
            q = pid - n_ssm
            b = q // n_cblocks
            ch = (q % n_cblocks) * BLOCK_C + tl.arange(0, BLOCK_C)
            ch_ok = ch < C
            t = tl.arange(0, KM1_P2)
            t_ok = t < KM1
            plen = tl.load(plen_ptr + b).to(tl.int32)
            # New column t is row plen + t of cat(old state columns, path rows).
            r = plen + t
            from_state = r < KM1
            m = r - KM1
            if PATH_IS_ARANGE:
                node = m
            else:
                node = tl.load(path_ptr + b * s_pb + m * s_pm, mask=t_ok & ~from_state, other=0)
            old = tl.load(cs_ptr + b * s_sb + ch[:, None] * s_sc + r[None, :] * s_sk,
                          mask=ch_ok[:, None] & (t_ok & from_state)[None, :], other=0.0)
            new = tl.load(xbc_ptr + b * s_cb + node[None, :] * s_cn + ch[:, None] * s_cc,
                          mask=ch_ok[:, None] & (t_ok & ~from_state)[None, :], other=0.0)
            val = tl.where(from_state[None, :], old.to(tl.float32), new.to(tl.float32))
            tl.debug_barrier()  # every old column is read before any is overwritten
            tl.store(cs_ptr + b * s_sb + ch[:, None] * s_sc + t[None, :] * s_sk,
                     val.to(cs_ptr.dtype.element_ty), mask=ch_ok[:, None] & t_ok[None, :])


def _launch(ssm, conv, path, path_len, path_is_arange, block_p=None, block_s=None, num_warps=None, exact=False):
    """One launch over the SSM part ``ssm = (state, x, dt, A, Bm)`` and/or the conv part ``conv = (state, xBC)``,
    each tensor with a leading layer axis (``[L, ...]``; one layer: ``L = 1``); ``block_p``, ``block_s`` and
    ``num_warps`` override the SSM tile. ``exact``: the SSM state steps node by node with the decode step's
    arithmetic (``replay_exact_ref``) instead of the closed form."""
    ref = path_len
    b = path_len.shape[0]
    layers = (ssm or conv)[0].shape[0]
    if ssm is not None:
        ssm_state, x, dt, A, Bm = ssm
        h, p, s = x.shape[3], x.shape[4], Bm.shape[4]
        # 64 headdim channels where a layer has 64+ (sequence, head) pairs to spread (faster than 32 there)
        bp = block_p or min(64 if b * h >= 64 else 32, max(16, triton.next_power_of_2(p)))
        bs = block_s or min(64, max(16, triton.next_power_of_2(s)))
        n_pblocks, n_sblocks = triton.cdiv(p, bp), triton.cdiv(s, bs)
        n_ssm, hpg = b * h * n_pblocks * n_sblocks, h // Bm.shape[3]
        ssm_strides = (*ssm_state.stride()[1:], *x.stride()[1:], *dt.stride()[1:], *Bm.stride()[1:])
        ssm_layer = (ssm_state.stride(0), x.stride(0), dt.stride(0), A.stride(0), Bm.stride(0))
    else:
        ssm_state = x = dt = A = Bm = ref
        h = p = s = hpg = n_pblocks = n_sblocks = n_ssm = 0
        bp = bs = 16
        ssm_strides = (0,) * 15
        ssm_layer = (0,) * 5
    if conv is not None and conv[0].shape[3] > 0:
        conv_state, xBC = conv
        c, km1 = xBC.shape[3], conv_state.shape[3]
        block_c = 256
        n_cblocks = triton.cdiv(c, block_c)
        n_conv = b * n_cblocks
        conv_strides = (*conv_state.stride()[1:], *xBC.stride()[1:])
        conv_layer = (conv_state.stride(0), xBC.stride(0))
    else:
        conv_state = xBC = ref
        c = km1 = n_cblocks = n_conv = 0
        block_c = 16
        conv_strides = (0,) * 6
        conv_layer = (0, 0)
    if n_ssm + n_conv == 0 or layers == 0:
        return
    s_h, s_x, s_d, s_B = ssm_strides[0:4], ssm_strides[4:8], ssm_strides[8:11], ssm_strides[11:15]
    _replay_kernel[(n_ssm + n_conv, layers)](
        ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len,
        h, p, s, c, path.shape[1], max(hpg, 1), max(n_pblocks, 1), max(n_sblocks, 1), n_ssm, max(n_cblocks, 1),
        ssm_layer[0], conv_layer[0], *ssm_layer[1:], conv_layer[1],
        *s_h, *conv_strides[0:3], *s_x, *s_d, *s_B, *conv_strides[3:6], *path.stride(),
        KM1=km1, KM1_P2=max(2, triton.next_power_of_2(max(km1, 1))), DO_SSM=n_ssm > 0, DO_CONV=n_conv > 0,
        PATH_IS_ARANGE=path_is_arange, EXACT=exact, BLOCK_M=16, BP=bp, BS=bs, BLOCK_C=block_c, num_warps=num_warps or 4,
        enable_fp_fusion=False, **pdl.launch_args(),
    )


def _check(ssm_state, conv_state, x, Bm, xBC, path, path_len, name="replay"):
    if x.dim() != 4 or ssm_state.shape != (x.shape[0], x.shape[2], x.shape[3], Bm.shape[-1]):
        raise ValueError(f"{name}: ssm_state {tuple(ssm_state.shape)} does not match x {tuple(x.shape)} "
                         f"and B {tuple(Bm.shape)}")
    if path.dim() != 2 or path.shape[0] != x.shape[0] or path_len.shape != (x.shape[0],):
        raise ValueError(f"{name}: path {tuple(path.shape)} / path_len {tuple(path_len.shape)} must be "
                         f"[{x.shape[0]}, M] / [{x.shape[0]}]")
    if conv_state.shape[:2] != (x.shape[0], xBC.shape[2]):
        raise ValueError(f"{name}: conv_state {tuple(conv_state.shape)} does not match xBC {tuple(xBC.shape)}")


def replay_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len, *, exact=False):
    """Triton ``replay_ref`` (``exact``: ``replay_exact_ref``): writes the new states into ``ssm_state`` and
    ``conv_state`` in place."""
    _check(ssm_state, conv_state, x, Bm, xBC, path, path_len)
    _launch((ssm_state[None], x[None], dt[None], A[None], Bm[None]), (conv_state[None], xBC[None]), path, path_len,
            False, exact=exact)


def replay_exact_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len):
    """Triton ``replay_exact_ref``: the accepted path stepped node by node, as decode steps would."""
    replay_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len, exact=True)


def replay_layers_exact_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len):
    """Triton ``replay_layers_exact_ref``: every layer's accepted path stepped node by node, in ONE launch."""
    replay_layers_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len, exact=True)


def replay_layers_triton(ssm_state, conv_state, x, dt, A, Bm, xBC, path, path_len, *, block_p=None, block_s=None,
                         num_warps=None, exact=False):
    """Triton ``replay_layers_ref``: every layer of the stacked ``[L, ...]`` tensors committed in ONE launch
    (``block_p``, ``block_s``, ``num_warps``: the SSM tile, as ``_launch``; ``exact`` as ``replay_triton``)."""
    if not (ssm_state.dim() == 5 and x.dim() == 5 and A.dim() == 2 and conv_state.dim() == 4
            and len({t.shape[0] for t in (ssm_state, conv_state, x, dt, A, Bm, xBC)}) == 1):
        raise ValueError("replay_layers: every tensor needs one leading layer axis of the same length "
                         f"(ssm_state {tuple(ssm_state.shape)}, x {tuple(x.shape)}, A {tuple(A.shape)})")
    _check(ssm_state[0], conv_state[0], x[0], Bm[0], xBC[0], path, path_len, "replay_layers")
    _launch((ssm_state, x, dt, A, Bm), (conv_state, xBC), path, path_len, False, block_p, block_s, num_warps, exact)


def replay_ssm_chain_triton(ssm_state, x, dt, A, Bm, length):
    """Fold the first ``length[b]`` rows of a chain (prefill chunk) into ``ssm_state``, in place."""
    _launch((ssm_state[None], x[None], dt[None], A[None], Bm[None]), None, length[:, None].expand(-1, x.shape[1]),
            length, True)


def replay_conv_chain_triton(conv_state, xBC, length):
    """Roll the first ``length[b]`` rows of ``xBC`` into ``conv_state`` (prefill), in place."""
    _launch(None, (conv_state[None], xBC[None]), length[:, None], length, True)
