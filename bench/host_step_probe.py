"""Where the host's time per engine step goes (trained pair, fp32, batch 1, one HumanEval-style prompt): the CPU
cost of one step-graph replay alone, then a cProfile of whole generations per tree shape. With ``sampled``: the GPU
time per step instead, greedy against T=1 (what sampled verification adds to a plain and a chain:4 step; engine
CUDA-event times, graphs captured first). GPU only.
``SPEC ...`` (default none chain:4 static:3,1,1,1; ``auto`` allowed) picks the shapes profiled.
Usage (repo root, after bench/gpu_start.sh): python3 bench/host_step_probe.py OUT.txt [sampled | SPEC ...]"""

import cProfile
import io
import pstats
import sys
import time

import torch
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import load_model

out = open(sys.argv[1], "w")


def p(s):
    print(s)
    out.write(s + "\n")
    out.flush()


target = load_model("checkpoints/demo-target", device="cuda", dtype=torch.float32)
draft = load_model("checkpoints/demo-draft", device="cuda", dtype=torch.float32)
prompt = list(range(100, 160))


def sampled_table():
    p(f"{'shape':10s} {'T':>3s} {'steps':>6s} {'GPU us/step':>12s} {'tokens/step':>12s} {'host us p50':>12s}")
    for spec in ("none", "chain:4"):
        kw = {} if spec == "none" else {"drafter": "mamba", "draft_model": draft, "tree": spec}
        for temperature in (0.0, 1.0):
            for _ in range(2):  # warm-up: captures every graph this shape and mode need
                generate(target, prompt, max_new_tokens=128, temperature=temperature, seed=0, **kw)
            before = generate(target, prompt, max_new_tokens=1, temperature=temperature, seed=0, **kw)
            res = generate(target, prompt, max_new_tokens=256, temperature=temperature, seed=1, **kw)
            m0, m1 = before.stats["engine_metrics"], res.stats["engine_metrics"]
            steps = m1["steps"] - m0["steps"]
            gpu = m1["gpu_s"] - m0["gpu_s"]
            p(f"{spec:10s} {temperature:3.0f} {steps:6d} {1e6 * gpu / steps:12.1f} "
              f"{len(res.token_ids) / res.stats['steps']:12.2f} {res.stats.get('host_us_p50', 0):12.1f}")


if sys.argv[2:] == ["sampled"]:
    sampled_table()
    sys.exit(0)
specs = sys.argv[2:] or ["none", "chain:4", "static:3,1,1,1"]
for spec in specs:
    kw = {} if spec == "none" else {"drafter": "mamba", "draft_model": draft, "tree": spec}
    for _ in range(2):  # warm-up: captures every graph this shape needs
        res = generate(target, prompt, max_new_tokens=128, **kw)
    engine = next(e for _, e, _ in target.__dict__["_stree_engines"].values()
                  if (e.goodput is not None) == (spec == "auto") and (spec == "auto" or spec in map(str, e.shapes)))
    graphs = [(k, g) for k, g in engine.graphs.items() if k[0] in ("none", "tree")]
    for key, graph in graphs[:2]:
        torch.cuda.synchronize()
        cpu = []
        for _ in range(20):
            t0 = time.perf_counter()
            graph.replay()
            cpu.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        p(f"{spec:16s} graph {key[:2]!s:40s} replay CPU p50 {1e6 * sorted(cpu)[10]:.1f} us")
    res = generate(target, prompt, max_new_tokens=128, **kw)  # fresh state after the raw replays
    prof = cProfile.Profile()
    prof.enable()
    res = generate(target, prompt, max_new_tokens=128, **kw)
    prof.disable()
    s = res.stats
    p(f"{spec:16s} steps {s['steps']}  host p50 {s.get('host_us_p50', 0):.1f} us  tok/s {s['tokens_per_s']:.0f}")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    p("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-3000:])
