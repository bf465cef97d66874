"""Why a drafted step at batch 4 costs more in a run than its graph replay timed at capture: runs the trained pair on
HumanEval prompts at batch 4 (plain, fixed chain:1, fixed chain:2; greedy), records every step's time (CUDA events on
a GPU), its running rows and whether a drafter catch-up ran in it, and prints them beside the capture-time replay cost
that goodput control starts from. Made for the GPU; on a CPU it runs eagerly (no capture-time costs), as a check.
Usage (repo root, after bench/gpu_start.sh): python3 bench/batch_step_probe.py OUT.txt [BATCH [PROMPT_SET]]"""

import statistics
import sys
import time
from collections import defaultdict

import torch

from stree.bench.common import cuda_sync, demo_pair, tee
from stree.bench.prompt_sets import load_prompt_set
from stree.verifier.decode.engine import Engine
from stree.verifier.decode.engine_pool import EnginePool
from stree.verifier.decode.loop import generate
from stree.verifier.decode.step_graphs import CATCH_UP
from stree.verifier.model.tokenizer import load_tokenizer

say = tee(sys.argv[1])
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
prompt_set = sys.argv[3] if len(sys.argv) > 3 else "humaneval"
torch.set_grad_enabled(False)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
target, draft = demo_pair(device)
tok = load_tokenizer("checkpoints/demo-target")
prompts = [tok.encode(t, add_special_tokens=False).ids[-512:] or [0]
           for _, t in load_prompt_set(prompt_set, 8, None, ".data")]

steps: list = []  # (shape, seconds, running rows, catch-up ran)
caught: list = []  # per launched step, in launch order: whether a catch-up ran before it
run, collect = Engine._run, Engine._collect
catching = [False]


def run_logged(self, key):
    if key.kind == CATCH_UP:
        catching[0] = True
    else:
        caught.append(catching[0])
        catching[0] = False
    return run(self, key)


def collect_logged(self, step):
    out = collect(self, step)
    running = sum(s is not None for s in step.slots)
    steps.append((str(step.shape), self.readback.seconds(step.turn), running, caught.pop(0) if caught else None))
    return out


Engine._run, Engine._collect = run_logged, collect_logged
say(f"trained pair, fp32, batch {batch}, 8 {prompt_set} prompts x 128 tokens, greedy, {device.type}; µs per step")
say("| tree | steps | mean µs | median µs | full-batch steps: mean µs | with catch-up | capture-time replay µs | "
    "refresh ms | tok/s |")
say("|---|---|---|---|---|---|---|---|---|")
for tree in (None, "chain:1", "chain:2"):
    pool = EnginePool()  # each tree's engines alone, freed after it
    kw = dict(max_new_tokens=128, max_batch=batch, pool=pool)
    if tree:
        kw.update(drafter="mamba", draft_model=draft, tree=tree)
    generate(target, prompts, **kw)  # warm-up: graphs captured
    steps.clear()
    caught.clear()
    cuda_sync()
    t0 = time.perf_counter()
    outs = generate(target, prompts, **kw)
    cuda_sync()
    wall = time.perf_counter() - t0
    mine = [s for s in steps if s[0] == (tree or "none")]
    full = [s[1] for s in mine if s[2] == batch]
    timed = {}  # capture-time replay seconds by shape (greedy graphs)
    for eng in pool.engines(target):
        for key, sec in eng.graphs.costs.items():
            if key.timed_shape is not None and not key.sampled:
                timed.setdefault(str(key.timed_shape), sec)
    metrics = outs[0].stats["engine_metrics"]
    full_us = 1e6 * statistics.mean(full) if full else float("nan")
    say(f"| {tree or 'plain'} | {len(mine)} | {1e6 * statistics.mean(s[1] for s in mine):.1f} | "
        f"{1e6 * statistics.median(s[1] for s in mine):.1f} | {full_us:.1f} "
        f"| {sum(1 for s in mine if s[3])} | {1e6 * timed.get(tree or 'none', float('nan')):.1f} | "
        f"{1e3 * metrics.get('refresh_s', 0.0):.2f} | {sum(len(o.token_ids) for o in outs) / wall:.0f} |")
    by_rows = defaultdict(list)
    for s in mine:
        by_rows[(s[2], bool(s[3]))].append(s[1])
    say("  by (running rows, catch-up): " + ", ".join(f"{k}: {len(v)} x {1e6 * statistics.mean(v):.0f} µs"
                                                     for k, v in sorted(by_rows.items())))
    pool.release(target)
