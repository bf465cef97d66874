"""Where admission time goes in the batched engine: plain vs ``--tree auto`` on the trained pair (GPU).

Usage (repo root, on the GPU box after bench/gpu_env.sh): ``python3 bench/admission_probe.py OUT.txt [BATCH]``.
After the same warm-up as ``stree bench batch``, one run per method is profiled; for every admission it
prints its host time, whether the GPU was still busy when it began, and the CUDA runtime calls inside it
(synchronizations, copies, launches) with their host time. Diagnostic only: nothing here is a benchmark row.
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from stree.protocols.registry import create_drafter
from stree.verifier.decode.engine import Engine
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.tokenizer import load_tokenizer
from torch.profiler import ProfilerActivity, profile, record_function

from stree.bench.batch import timed
from stree.bench.prompt_sets import load_prompt_set

RUNTIME = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
           "cudaLaunchKernel", "cudaGraphLaunch", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cuLaunchKernel")


def main(out_path: str, batch: int = 4) -> None:
    dev = torch.device("cuda")
    target = load_model("checkpoints/demo-target", device=dev, dtype=torch.float32)
    draft = load_model("checkpoints/demo-draft", device=dev, dtype=torch.float32)
    tok = load_tokenizer("checkpoints/demo-target")
    prompts = [tok.encode(t, add_special_tokens=False).ids[-512:] or [0]
               for _, t in load_prompt_set("humaneval", 8, None, None)]
    lines = []
    original = Engine._admit
    log: list = []

    def admit(self):
        busy = not torch.cuda.current_stream().query()
        t0 = time.perf_counter()
        with record_function("stree_admit"):
            original(self)
        log.append((busy, time.perf_counter() - t0, len(self.waiting)))

    for name, drafter, opts in (("plain", None, {}), ("auto", "mamba", {"draft_model": draft, "tree": "auto"})):
        d = create_drafter(drafter, **opts) if drafter else None
        res = timed(target, prompts, d, batch, 128, 0.0, repeats=1)
        lines.append(f"{name}: warm run {res['tokens_per_s']:.0f} tok/s, engine admit_s "
                     f"{res['engine'].get('admit_s', 0) * 1e3:.2f} ms")
        Engine._admit = admit
        log.clear()
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                generate(target, prompts, drafter=d, max_new_tokens=128, temperature=0.0, seed=0, max_batch=batch)
                torch.cuda.synchronize()
        finally:
            Engine._admit = original
        events = prof.events()
        # the CPU range only: the profiler also records a GPU-side annotation of the same name for admissions
        # that launched work, which would shift every later admission onto the wrong range
        ranges = [e for e in events if e.name == "stree_admit" and e.device_type == torch.autograd.DeviceType.CPU]
        for k, (r, (busy, secs, waiting)) in enumerate(zip(ranges, log)):
            calls: dict = collections.defaultdict(lambda: [0, 0.0])
            for e in events:
                if e.name in RUNTIME and r.time_range.start <= e.time_range.start <= r.time_range.end:
                    calls[e.name][0] += 1
                    calls[e.name][1] += e.time_range.elapsed_us() / 1e3
            detail = ", ".join(f"{n} x{c} {ms:.2f} ms" for n, (c, ms) in sorted(calls.items(), key=lambda x: -x[1][1]))
            lines.append(f"  {name} admission {k}: host {secs * 1e3:.2f} ms (profiled {r.cpu_time_total / 1e3:.2f}),"
                         f" GPU busy at start: {busy}, still waiting after: {waiting}; {detail}")
        totals: dict = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            if e.name in RUNTIME:
                totals[e.name][0] += 1
                totals[e.name][1] += e.time_range.elapsed_us() / 1e3
        lines.append(f"  {name} whole run: " + ", ".join(f"{n} x{c} {ms:.1f} ms" for n, (c, ms) in
                                                        sorted(totals.items(), key=lambda x: -x[1][1])))
    text = "\n".join(lines)
    print(text)
    with open(out_path, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
