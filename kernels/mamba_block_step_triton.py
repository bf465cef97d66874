"""A whole Mamba2 block's decode step in ONE persistent Triton launch (reference: ``mamba_block_step_ref``).

At batch 1 a block's step is three small launches (norm + ``in_proj``, ``mamba_step``, gated norm +
``out_proj``), each a few microseconds of work behind a launch gap and a ramp. Here one launch of at most a
few programs per SM runs the three as phases over the same tiles and work items as the three kernels
(``linear_rows_tile``, ``mamba_step_item``), separated by grid barriers: a counter in global memory that
every program increments (release) and polls (acquire) until all have arrived. That needs every program
resident at once, so the grid never exceeds what the SMs hold (``resident_programs``), and a barrier that
waits too long gives up and raises an error flag instead of hanging the GPU.

``phased=True`` runs the same kernel as three launches, one phase each, with no barrier: the CPU
interpreter runs programs one after another, so a barrier there would wait forever.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels.linear_rows_triton import MAX_ROWS, config, linear_rows_tile
from stree.kernels.mamba_block_step import MambaBlockParams, split_zxbcdt
from stree.kernels.mamba_step_triton import mamba_step_item

MAX_SPIN = tl.constexpr(1 << 22)  # polls before a barrier gives up (seconds on a GPU; a healthy barrier takes a few)
SYNC_WORDS = 4  # [arrivals, programs done, error flag, unused], then the step's B/C conv-roll counters
_SYNC: dict[tuple[str, int], torch.Tensor] = {}
_RESIDENT: dict = {}


@triton.jit
def grid_barrier(sync_ptr, target):
    """Wait until ``target`` arrivals were counted at ``sync_ptr[0]`` (this program's included): every store
    before it is visible to every program after it. Gives up after ``MAX_SPIN`` polls, setting ``sync_ptr[2]``."""
    tl.debug_barrier()  # every thread of this program has stored its part
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    spins = 0
    while (tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPIN):
        spins += 1
    if spins >= MAX_SPIN:
        tl.atomic_xchg(sync_ptr + 2, 1)
    tl.debug_barrier()


@triton.jit
def _mamba_block_step_kernel(
    x_ptr, r_ptr, nw_ptr, inw_ptr, inb_ptr, zx_ptr, rout_ptr, M, N_IN, s_xm, s_rm, s_inn, s_ink, s_zxm, s_om, eps1,
    cs_ptr, h_ptr, xbc_ptr, dtr_ptr, cw_ptr, cb_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr,
    H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
    s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs, s_wc, s_wk, s_ym,
    z_ptr, gw_ptr, outw_ptr, outb_ptr, out_ptr, N_OUT, s_outn, s_outk, s_outm, eps3, sync_ptr,
    PHASE: tl.constexpr,
    K1: tl.constexpr, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, UNROLL1: tl.constexpr,
    STAGES1: tl.constexpr, HAS_RES: tl.constexpr, IN_BIAS: tl.constexpr,
    KM1: tl.constexpr, K_P2: tl.constexpr, CONV_BIAS: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
    CLAMP: tl.constexpr, BP: tl.constexpr, BS: tl.constexpr,
    G3: tl.constexpr, GS3: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr, UNROLL3: tl.constexpr,
    STAGES3: tl.constexpr, NBG: tl.constexpr, OUT_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PHASE == 0 or PHASE == 1:  # residual add + RMSNorm + in_proj -> zxbcdt (tile 0 writes the residual)
        for t in range(pid, tl.cdiv(N_IN, BN1), nprog):
            linear_rows_tile(t, x_ptr, r_ptr, x_ptr, nw_ptr, inw_ptr, inb_ptr, zx_ptr, rout_ptr,
                             M, N_IN, s_xm, 1, s_rm, 0, s_inn, s_ink, s_zxm, s_om, eps1,
                             1, K1, BM, BN1, BK1, UNROLL1, STAGES1, 1, HAS_RES, False, IN_BIAS, False)
    if PHASE == 0:
        grid_barrier(sync_ptr, nprog)
    if PHASE == 0 or PHASE == 2:  # conv + dt + SSM update -> y + D x, one (sequence, head, headdim block) per item
        for it in range(pid, M * H * n_pblocks, nprog):
            mamba_step_item(it, cs_ptr, h_ptr, xbc_ptr, dtr_ptr, cw_ptr, cb_ptr, dtb_ptr, A_ptr, D_ptr, y_ptr,
                            sync_ptr + 4, cs_ptr, cs_ptr, h_ptr, H, P, S, G, heads_per_group, n_pblocks, dt_lo, dt_hi,
                            s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs, s_zxm, 1, s_zxm, 1, s_wc, s_wk, s_ym, 1,
                            s_sb, s_sc, s_sk, s_hb, s_hh, s_hp, s_hs,
                            KM1, K_P2, CONV_BIAS, True, D_PER_CHANNEL, CLAMP, BP, BS, False, False)
    if PHASE == 0:
        grid_barrier(sync_ptr, 2 * nprog)
    if PHASE == 0 or PHASE == 3:  # gated RMSNorm + out_proj -> out
        for t in range(pid, tl.cdiv(N_OUT, BN3), nprog):
            linear_rows_tile(t, y_ptr, y_ptr, z_ptr, gw_ptr, outw_ptr, outb_ptr, out_ptr, out_ptr,
                             M, N_OUT, s_ym, 1, 0, s_zxm, s_outn, s_outk, s_outm, 0, eps3,
                             G3, GS3, BM, BN3, BK3, UNROLL3, STAGES3, 2, False, NBG, OUT_BIAS, False)
    if PHASE == 0:  # the last program out leaves the counters at zero for the next launch
        if tl.atomic_add(sync_ptr + 1, 1) == nprog - 1:
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


def sync_buffer(device: torch.device, counters: int) -> torch.Tensor:
    """Zeroed int32 barrier words and conv-roll counters, one buffer per device (allocated by the first, eager
    call: the once-per-shape timing runs before any capture). Every launch leaves them at zero; the error flag
    stays set once raised (``barrier_failed``). Launches never overlap: the engine runs one stream."""
    key = str(device)
    buf = _SYNC.get(key)
    if buf is None or buf.numel() < SYNC_WORDS + counters:
        buf = torch.zeros(SYNC_WORDS + max(counters, 1024), dtype=torch.int32, device=device)
        _SYNC[key] = buf
    return buf


def barrier_failed(device: torch.device) -> bool:
    """Whether a barrier of a launch on ``device`` ever gave up (tests; syncs)."""
    buf = _SYNC.get(str(device))
    return buf is not None and bool(buf[2].item())


def resident_programs(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of ``compiled`` the GPU holds at once (registers, shared memory, warps per SM)."""
    props = torch.cuda.get_device_properties(device)
    try:
        compiled._init_handles()
        regs = max(int(compiled.n_regs), 1)
    except (AttributeError, RuntimeError):
        return props.multi_processor_count
    threads = 32 * num_warps
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs * threads),
                 props.max_threads_per_multi_processor // threads,
                 props.shared_memory_per_multiprocessor // max(int(compiled.metadata.shared), 1), 32)
    return max(per_sm, 0) * props.multi_processor_count


def _check(x, residual, p: MambaBlockParams, conv_state, ssm_state):
    b, d = x.shape
    h, hp, s = ssm_state.shape[1:]
    d_ssm, c = p.gnorm_w.numel(), p.conv_w.shape[0]
    if not 1 <= b <= MAX_ROWS or ssm_state.shape[0] != b or h * hp != d_ssm or c != d_ssm + 2 * p.ngroups * s:
        raise ValueError(f"mamba_block_step: x {tuple(x.shape)} (1..{MAX_ROWS} rows), ssm_state "
                         f"{tuple(ssm_state.shape)}, gated norm {d_ssm} and conv {c} channels do not fit together")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"mamba_block_step: residual {tuple(residual.shape)} must be {tuple(x.shape)}")
    if p.in_w.shape != (d_ssm + c + h, d) or p.out_w.shape != (d, d_ssm) or d_ssm % p.group_size:
        raise ValueError(f"mamba_block_step: in_proj {tuple(p.in_w.shape)} must be [{d_ssm + c + h}, {d}], out_proj "
                         f"{tuple(p.out_w.shape)} [{d}, {d_ssm}], group size {p.group_size} must divide {d_ssm}")
    km1 = p.conv_w.shape[1] - 1
    if km1 < 1 or conv_state.shape != (b, c, km1) or p.D.numel() not in (h, h * hp):
        raise ValueError(f"mamba_block_step: conv_state {tuple(conv_state.shape)} must be [{b}, {c}, {km1}] "
                         f"(K >= 2), D ({p.D.numel()}) must have {h} or {h * hp} entries")


def mamba_block_step_triton(x: torch.Tensor, residual, p: MambaBlockParams, conv_state: torch.Tensor,
                            ssm_state: torch.Tensor, *, phased: bool | None = None, programs_per_sm: int = 2,
                            num_warps: int = 4, block_p: int | None = None, block_n: int | None = None):
    """Triton ``mamba_block_step_ref``: ``(out [B, d], new residual [B, d])``, both states updated in place.

    ``phased`` (default: on the CPU) runs three launches without barriers. ``programs_per_sm`` caps the
    persistent grid (never above what is resident at once; one program on the CPU interpreter); ``num_warps``
    ``block_p`` and ``block_n`` (projection columns per tile) are tile knobs."""
    _check(x, residual, p, conv_state, ssm_state)
    if phased is None:
        phased = not x.is_cuda
    b, d = x.shape
    h, hp, s = ssm_state.shape[1:]
    d_ssm = p.gnorm_w.numel()
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    n_in = p.in_w.shape[0]
    zx = torch.empty(b, n_in, device=x.device, dtype=x.dtype)
    z, xBC, dt_raw = split_zxbcdt(zx, p)
    rout = torch.empty(b, d, device=x.device, dtype=torch.float32 if p.residual_in_fp32 else x.dtype)
    y = torch.empty(b, d_ssm, device=x.device, dtype=x.dtype)
    out = torch.empty(b, d, device=x.device, dtype=x.dtype)
    cfg1, cfg3 = config(b, n_in, d, p.in_w.dtype), config(b, d, d_ssm, p.out_w.dtype)
    if block_n:
        cfg1, cfg3 = ({**c, "block_n": block_n, "block_k": min(c["block_k"], 16384 // (max(2, triton.next_power_of_2(b)) * block_n))}
                      for c in (cfg1, cfg3))
    bm = max(2, triton.next_power_of_2(b))
    bp = min(block_p or 16, triton.next_power_of_2(hp))
    n_pblocks = triton.cdiv(hp, bp)
    lo, hi = p.dt_limit
    km1 = p.conv_w.shape[1] - 1
    sync = sync_buffer(x.device, b * p.ngroups)
    args = (
        x, residual if residual is not None else x, p.norm_w, p.in_w, p.in_b if p.in_b is not None else p.in_w, zx,
        rout, b, n_in, x.stride(0), residual.stride(0) if residual is not None else 0, *p.in_w.stride(),
        zx.stride(0), rout.stride(0), p.norm_eps,
        conv_state, ssm_state, xBC, dt_raw, p.conv_w, p.conv_b if p.conv_b is not None else p.conv_w, p.dt_bias,
        p.A, p.D, y, h, hp, s, p.ngroups, h // p.ngroups, n_pblocks, float(lo), float(min(hi, 3.0e38)),
        *conv_state.stride(), *ssm_state.stride(), *p.conv_w.stride(), y.stride(0),
        z, p.gnorm_w, p.out_w, p.out_b if p.out_b is not None else p.out_w, out, d, *p.out_w.stride(), out.stride(0),
        p.gnorm_eps, sync,
    )
    consts = dict(
        K1=d, BM=bm, BN1=cfg1["block_n"], BK1=min(cfg1["block_k"], triton.next_power_of_2(d)),
        UNROLL1=cfg1["unroll"], STAGES1=cfg1["num_stages"], HAS_RES=residual is not None, IN_BIAS=p.in_b is not None,
        KM1=km1, K_P2=triton.next_power_of_2(km1 + 1), CONV_BIAS=p.conv_b is not None,
        D_PER_CHANNEL=p.D.numel() == h * hp and p.D.numel() != h, CLAMP=lo > 0.0 or hi < float("inf"), BP=bp,
        BS=min(128, max(16, triton.next_power_of_2(s))),
        G3=d_ssm // p.group_size, GS3=p.group_size, BN3=cfg3["block_n"],
        BK3=min(cfg3["block_k"], triton.next_power_of_2(p.group_size)), UNROLL3=cfg3["unroll"],
        STAGES3=cfg3["num_stages"], NBG=p.norm_before_gate, OUT_BIAS=p.out_b is not None, num_warps=num_warps,
    )
    items = max(triton.cdiv(n_in, consts["BN1"]), b * h * n_pblocks, triton.cdiv(d, consts["BN3"]))
    if phased:
        for phase in (1, 2, 3):
            _mamba_block_step_kernel[(items,)](*args, PHASE=phase, **consts)
        return out, rout
    if not x.is_cuda:  # the interpreter runs programs one after another: only one program passes a barrier
        grid = 1
    else:
        key = (x.device, tuple(sorted((k, v) for k, v in consts.items())))
        if key not in _RESIDENT:  # compiled once per configuration, never launched here
            compiled = _mamba_block_step_kernel.warmup(*args, PHASE=0, grid=(1,), **consts)
            _RESIDENT[key] = resident_programs(compiled, num_warps, x.device)
        n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = max(1, min(items, _RESIDENT[key], programs_per_sm * n_sm))
    _mamba_block_step_kernel[(grid,)](*args, PHASE=0, **consts)
    return out, rout
