"""Why a drafted step at batch 4 costs more in a run than its graph replay timed at capture: runs the trained pair on
HumanEval prompts at batch 4 (plain, fixed chain:1, fixed chain:2; greedy), records every step's CUDA-event time, its
running rows and whether a drafter catch-up ran in it, and prints them beside the capture-time replay cost that goodput
control starts from. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/batch_step_probe.py OUT.txt [BATCH]"""

import statistics
import sys
import time
from collections import defaultdict

import torch

from stree.bench.common import demo_pair, tee
from stree.bench.prompt_sets import load_prompt_set
from stree.verifier.decode import engine as engine_mod
from stree.verifier.decode.loop import generate, release_engines
from stree.verifier.model.tokenizer import load_tokenizer

say = tee(sys.argv[1])
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_grad_enabled(False)
target, draft = demo_pair(torch.device("cuda"))
tok = load_tokenizer("checkpoints/demo-target")
prompts = [tok.encode(t, add_special_tokens=False).ids[-512:] or [0]
           for _, t in load_prompt_set("humaneval", 8, None, ".data")]

steps: list = []  # (shape, seconds, running rows, catch-up ran)
caught: list = []
run_step, collect = engine_mod.Engine._run_step, engine_mod.Engine._collect


def run_step_logged(self, key, catch_up):
    caught.append(catch_up)
    return run_step(self, key, catch_up)


def collect_logged(self, step):
    out = collect(self, step)
    t = step.timer
    seconds = t[0] if len(t) == 1 else t[0].elapsed_time(t[1]) / 1e3
    steps.append((str(step.shape), seconds, sum(s is not None for s in step.slots), caught.pop(0) if caught else None))
    return out


engine_mod.Engine._run_step, engine_mod.Engine._collect = run_step_logged, collect_logged
say(f"trained pair, fp32, batch {batch}, 8 HumanEval prompts x 128 tokens, greedy; µs per step (CUDA events)")
say("| tree | steps | mean µs | median µs | full-batch steps: mean µs | with catch-up | capture-time replay µs | "
    "refresh ms | tok/s |")
say("|---|---|---|---|---|---|---|---|---|")
for tree in (None, "chain:1", "chain:2"):
    kw = dict(max_new_tokens=128, max_batch=batch)
    if tree:
        kw.update(drafter="mamba", draft_model=draft, tree=tree)
    generate(target, prompts, **kw)  # warm-up: graphs captured
    steps.clear()
    caught.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = generate(target, prompts, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    mine = [s for s in steps if s[0] == (tree or "none")]
    full = [s[1] for s in mine if s[2] == batch]
    timed = {}  # capture-time replay seconds by shape (greedy graphs)
    for _, eng, _ in target.__dict__.get("_stree_engines", {}).values():
        for key, sec in eng.step_costs.items():
            if key[0] == "none" and not key[1]:  # ("none", sampled, ...) / ("tree", shape, sampled, ...)
                timed.setdefault("none", sec)
            elif key[0] == "tree" and not key[2]:
                timed.setdefault(str(key[1]), sec)
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
    release_engines(target)
