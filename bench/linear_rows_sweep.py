"""The few-row Triton projection (``kernels/linear_rows_triton.py``) and its fused norm prologues against
cuBLAS, on the 2.7B, 130M and demo-pair projection shapes at 1/4/16 rows: a correctness check in fp32 and bf16
first, then graphed microseconds per call over tile configs (weights rotated over copies so they stream
from HBM). GPU only. Usage (repo root, after bench/gpu_start.sh): python3 bench/linear_rows_sweep.py OUT.txt
Recorded run: results/linear-rows-sweep-h100-20261124.txt (BENCHMARKS.md §0h)."""

import sys, time, torch, torch.nn.functional as F
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.linear_rows_triton import (
    linear_rows_triton,
    add_rmsnorm_linear_rows_triton,
    gated_rmsnorm_linear_rows_triton,
)
from stree.kernels.norm_linear import add_rmsnorm_linear_ref, gated_rmsnorm_linear_ref
from stree.kernels.norms_triton import add_rmsnorm_triton, gated_rmsnorm_triton

out = open(sys.argv[1], "w")


def p(*a):
    s = " ".join(str(x) for x in a)
    print(s)
    out.write(s + "\n")
    out.flush()


dev = "cuda"
torch.manual_seed(0)
t0 = time.time()
# correctness, bf16 and fp32
for dt, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
    for m, k, n in ((1, 2560, 10576), (4, 5120, 2560), (5, 256, 1160), (3, 768, 3352)):
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) / k**0.5
        r = torch.randn(m, k, device=dev, dtype=torch.float32)
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        e1 = (
            (linear_rows_triton(x, w) - F.linear(x, w)).float().abs().max() / F.linear(x, w).float().abs().max()
        ).item()
        y, ro = add_rmsnorm_linear_rows_triton(x, r, nw, 1e-5, True, w)
        y0, ro0 = add_rmsnorm_linear_ref(x, r, nw, 1e-5, True, w)
        e2 = ((y - y0).float().abs().max() / y0.float().abs().max()).item()
        e2r = (ro - ro0).abs().max().item()
        z = torch.randn(m, k, device=dev, dtype=dt)
        gs = k // 2 if k % 2 == 0 else k
        o = gated_rmsnorm_linear_rows_triton(x, z, nw, gs, 1e-5, False, w)
        o0 = gated_rmsnorm_linear_ref(x, z, nw, gs, 1e-5, False, w)
        e3 = ((o - o0).float().abs().max() / o0.float().abs().max()).item()
        ok = max(e1, e2, e3) < tol and e2r < 1e-5
        p(
            f"check {str(dt)[6:]} m{m} k{k} n{n}: lin {e1:.1e} add {e2:.1e}/{e2r:.1e} gated {e3:.1e} {'OK' if ok else 'FAIL'}"
        )
p(f"checks {time.time() - t0:.0f}s")


# timing: weights rotated over copies (~3x L2) so they stream from HBM
def rot(n, k, dt):
    c = max(1, int(150e6 // (n * k * (2 if dt == torch.bfloat16 else 4))))
    return [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(min(c, 8))]


def t_us(fn_list):
    return graphed_us(fn_list, reps=20)


shapes = [
    ("2.7b_in", 2560, 10576, torch.bfloat16),
    ("2.7b_out", 5120, 2560, torch.bfloat16),
    ("130m_in", 768, 3352, torch.bfloat16),
    ("130m_out", 1536, 768, torch.bfloat16),
    ("pair_in", 256, 1160, torch.float32),
    ("pair_out", 512, 256, torch.float32),
]
KN = [
    dict(),
    dict(block_n=4, block_k=512, num_stages=3),
    dict(block_n=8, block_k=512, num_stages=3),
    dict(block_n=16, block_k=256, num_stages=3),
    dict(block_n=8, block_k=1024, num_stages=2),
    dict(block_n=4, block_k=1024, num_stages=4),
    dict(block_n=8, block_k=512, num_stages=4, num_warps=8),
    dict(block_n=4, block_k=256, unroll=True),
]
for name, k, n, dt in shapes:
    ws = rot(n, k, dt)
    bytes_ = n * k * ws[0].element_size()
    for m in (1, 4, 16):
        x = torch.randn(m, k, device=dev, dtype=dt)
        cub = t_us([lambda w=w: F.linear(x, w) for w in ws])
        row = [f"{name} m{m}: cublas {cub:.2f}us ({bytes_ / cub / 1e3:.0f} GB/s)"]
        best = None
        for kn in KN if k > 2048 else KN[:1] + KN[-1:]:
            try:
                t = t_us([lambda w=w: linear_rows_triton(x, w, **kn) for w in ws])
            except Exception as e:  # noqa
                row.append(f"{kn}: ERR {type(e).__name__}")
                continue
            row.append(f"{kn or 'default'} {t:.2f}")
            best = t if best is None else min(best, t)
        p(" | ".join(row) + f" || best triton {best:.2f} ({bytes_ / best / 1e3:.0f} GB/s)")
        # fused vs unfused (norm kernel + cuBLAS), default config
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        if name.endswith("_in"):
            r = torch.randn(m, k, device=dev, dtype=torch.float32)
            fu = t_us([lambda w=w: add_rmsnorm_linear_rows_triton(x, r, nw, 1e-5, True, w) for w in ws])
            un = t_us([lambda w=w: F.linear(add_rmsnorm_triton(x, r, nw, 1e-5, True)[0], w) for w in ws])
            un2 = t_us([lambda w=w: linear_rows_triton(add_rmsnorm_triton(x, r, nw, 1e-5, True)[0], w) for w in ws])
        else:
            z = torch.randn(m, k, device=dev, dtype=dt)
            gs = k
            fu = t_us([lambda w=w: gated_rmsnorm_linear_rows_triton(x, z, nw, gs, 1e-5, False, w) for w in ws])
            un = t_us([lambda w=w: F.linear(gated_rmsnorm_triton(x, z, nw, gs, 1e-5, False), w) for w in ws])
            un2 = t_us([lambda w=w: linear_rows_triton(gated_rmsnorm_triton(x, z, nw, gs, 1e-5, False), w) for w in ws])
        p(f"   fused {fu:.2f} vs norm+cublas {un:.2f} vs norm+triton {un2:.2f}")
    p(f"t={time.time() - t0:.0f}s")
