"""``mamba_step_triton`` tiles (headdim channels per program x warps) at the 2.7B layer shape, batch 1/4/16/64,
each checked against ``mamba_step_ref``, in graphed us per layer beside the state-traffic floor. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/mamba_step_sweep.py OUT.txt
Recorded run: results/mamba-step-tiles-h100-20261124.txt (BENCHMARKS.md §0h; mamba_ssm's kernel did not import
in that run, so it has no anchor column)."""

import sys, torch
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.mamba_step_triton import mamba_step_triton
from stree.kernels.mamba_step import mamba_step_ref

out = open(sys.argv[1], "w")


def p(s):
    print(s)
    out.write(s + "\n")
    out.flush()


dev = "cuda"
h, P, S, G, K = 80, 64, 128, 1, 4
c = h * P + 2 * G * S
try:
    from stree.bench.kernels import import_mamba_ssm

    import_mamba_ssm()  # mamba_ssm's Triton kernels without its CUDA extension (DESIGN.md section 4)
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
except Exception as e:  # noqa: BLE001 - the anchor is optional; say why it is missing
    selective_state_update = None
    p(f"no mamba_ssm: {e}")
for b in (1, 4, 16, 64):
    copies = max(1, min(6, int(200e6 // (b * h * P * S * 4))))
    sts = [
        (torch.randn(b, c, K - 1, device=dev, dtype=torch.bfloat16), torch.randn(b, h, P, S, device=dev))
        for _ in range(copies)
    ]
    xbc = torch.randn(b, c, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(b, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(c, K, device=dev, dtype=torch.bfloat16) * 0.3
    cb = torch.randn(c, device=dev, dtype=torch.bfloat16)
    dtb = torch.randn(h, device=dev)
    A = -torch.rand(h, device=dev)
    D = torch.randn(h, device=dev)
    # correctness of every config against the reference
    row = [f"b={b}:"]
    bytes_ = 2 * b * h * P * S * 4
    for bp in (8, 16, 32, 64):
        for nw in (2, 4, 8):
            cs, ss = sts[0][0].clone(), sts[0][1].clone()
            cs2, ss2 = cs.clone(), ss.clone()
            y = mamba_step_triton(cs, ss, xbc, dt, w, cb, dtb, A, D, G, block_p=bp, num_warps=nw)
            y0 = mamba_step_ref(cs2, ss2, xbc, dt, w, cb, dtb, A, D, G)
            err = ((ss - ss2).abs().max() / ss2.abs().max()).item()
            t = graphed_us(
                [
                    lambda s=s_: mamba_step_triton(s[0], s[1], xbc, dt, w, cb, dtb, A, D, G, block_p=bp, num_warps=nw)
                    for s_ in sts
                ],
                reps=20,
            )
            row.append(f"bp{bp}/nw{nw} {t:.1f}us{'' if err < 1e-3 else ' ERR'}")
    if selective_state_update is not None:
        # as mamba_ssm's Mamba2.step calls it: per-head A, dt, D, dt_bias broadcast over headdim and state (stride 0)
        x = torch.randn(b, h, P, device=dev, dtype=torch.bfloat16)
        dtm = dt[:, :, None].expand(b, h, P)
        Am = A[:, None, None].expand(h, P, S)
        Bm = torch.randn(b, G, S, device=dev, dtype=torch.bfloat16)
        Cm = Bm.clone()
        Dm = D[:, None].expand(h, P)
        z = None
        dtbm = dtb[:, None].expand(h, P)
        t = graphed_us(
            [
                lambda s=s_: selective_state_update(s[1], x, dtm, Am, Bm, Cm, Dm, z, dtbm, dt_softplus=True)
                for s_ in sts
            ],
            reps=20,
        )
        row.append(f"mamba_ssm ssu {t:.1f}us")
    row.append(f"state floor {bytes_ / 3.0e12 * 1e6:.1f}us")
    p(" | ".join(row))
