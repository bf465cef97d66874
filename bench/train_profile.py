"""Where a training step of the scale pair's target spends its GPU time (diagnosis for fast training).

Builds the 48-layer, d_model-1024 hybrid target (attention at layers 16 and 32, vocab 8192) and runs the training
step ``stree train`` runs on one GPU (``TrainForward``, bf16 autocast, the chunked cross-entropy, fused AdamW) on
random windows: a few warm-up steps, then timed steps (tokens/s and MFU by ``training.flops``), then one profiled
step whose CUDA kernels are summed by name (top ``--top``). Usage:
``python bench/train_profile.py [--rows 8] [--seq-len 1024] [--compile] [--recompute]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from stree.training.fast_forward import TrainForward, head
from stree.training.flops import mfu, train_flops_per_token
from stree.training.losses import linear_cross_entropy
from stree.training.model_shape import Shape, make_model
from stree.training.run_settings import autocast


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--recompute", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = make_model(Shape(args.d_model, args.layers, (args.layers // 3, 2 * args.layers // 3)), 8192, 0, device)
    model.train()
    fwd = TrainForward(model, compile=args.compile, recompute=args.recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 8192, (args.rows, args.seq_len + 1), device=device)

    def step():
        with autocast(device):
            w, scale = head(model)
            loss = linear_cross_entropy(fwd(x[:, :-1]), w, x[:, 1:], scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(2):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    sec = (time.perf_counter() - t0) / args.steps
    tokens = args.rows * args.seq_len
    fpt = train_flops_per_token(model, args.seq_len)
    util = mfu(tokens / sec * fpt, device, 1)
    params = sum(p.numel() for p in model.parameters())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
        step()
        sync()
    # with CPU activity on, the kernels autograd's thread launches (the backward pass) are recorded too
    events = [e for e in prof.key_averages() if e.self_device_time_total or device.type != "cuda"]
    total = sum((e.self_device_time_total or e.self_cpu_time_total) for e in events) or 1.0
    rows = sorted(events, key=lambda e: (e.self_device_time_total or e.self_cpu_time_total), reverse=True)[: args.top]
    print(f"[train-profile] kernels of one step (GPU time {total / 1000:.1f} ms; wall {sec * 1000:.1f} ms):")
    for e in rows:
        print(f"  {(e.self_device_time_total or e.self_cpu_time_total) / total * 100:5.1f} %  {(e.self_device_time_total or e.self_cpu_time_total) / 1000:8.2f} ms  "
              f"x{e.count:<5d} {e.key[:110]}")
    print(f"[train-profile] params {params / 1e6:.1f}M, {args.rows}x{args.seq_len} tokens, compile={args.compile} "
          f"recompute={args.recompute}: first step {first:.1f} s, {sec * 1000:.1f} ms/step, "
          f"{tokens / sec:,.0f} tokens/s, MFU {util if util is None else round(util, 3)}, "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30 if device.type == 'cuda' else 0:.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
