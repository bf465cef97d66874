"""Goodput control replayed on recorded greedy acceptance: what ``--tree auto`` would do with exact acceptance.

The trained pair's greedy continuation of each prompt is generated once; at every position the draft model's
greedy chain of ``--depth`` tokens is compared with it, which gives how many drafted tokens a chain:K step from
that position would accept (greedy acceptance is exact: the longest common prefix). Then plain decoding, every
fixed chain and the goodput controller walk the same sequences with step costs taken from a GPU record (an e2e
auto row's ``goodput`` table), a drafter refresh whenever a draft follows more than ``CATCH_UP`` plain steps, and
a catch-up otherwise. Runs on the CPU: it separates the controller's choices from the GPU's timing noise.
Usage (repo root): python3 bench/goodput_replay.py OUT.txt [--costs-from RESULTS.json] [--prompt-set humaneval]
"""

from __future__ import annotations

import argparse
import json

import torch

from stree.bench.e2e import encode_prompts
from stree.bench.prompt_sets import load_prompt_set
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.drafter_slots import CATCH_UP
from stree.verifier.decode.goodput import EXPLORE_BUDGET, EXPLORE_WINDOW, GoodputController
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.tokenizer import load_tokenizer


def traces(prompt_set: str, n: int, new_tokens: int, depth: int, data_dir: str) -> list[list[int]]:
    """Per prompt, per generated position: drafted tokens a chain:``depth`` step from there accepts."""
    target = load_model("checkpoints/demo-target", device="cpu", dtype=torch.float32)
    draft = load_model("checkpoints/demo-draft", device="cpu", dtype=torch.float32)
    tok = load_tokenizer("checkpoints/demo-target")
    prompts = [ids for _, ids in encode_prompts(tok, load_prompt_set(prompt_set, n, None, data_dir), 1024)]
    outs = [r.token_ids for r in generate(target, prompts, max_new_tokens=new_tokens + depth, max_batch=len(prompts))]
    result = []
    for ids, out in zip(prompts, outs):
        contexts = [ids + out[:p] for p in range(new_tokens)]
        drafts = [r.token_ids for r in generate(draft, contexts, max_new_tokens=depth, max_batch=64)]
        accepted = []
        for p, d in enumerate(drafts):
            k = 0
            while k < depth and d[k] == out[p + k]:
                k += 1
            accepted.append(k)
        result.append(accepted)
    return result


def replay(trace: list[list[int]], policy, costs: dict, refresh_s: float, catch_up_s: float, new_tokens: int):
    """Walk every prompt with ``policy`` (a TreeShape, or a GoodputController); returns (seconds, steps, counts)."""
    seconds, steps, counts = 0.0, 0, {}
    ctl = policy if isinstance(policy, GoodputController) else None
    for accepted in trace:
        p, behind, stale = 0, 0, True  # a new request: the drafter is prefilled only when a draft is chosen
        while p < new_tokens:
            shape = ctl.choose() if ctl else policy
            refresh = catch_up = 0.0
            if shape.kind == "none":
                emitted = 1
                behind += 1
                if behind > CATCH_UP:
                    stale = True
            else:
                emitted = min(accepted[p], shape.max_depth) + 1
                if stale:
                    refresh = refresh_s
                elif behind:
                    catch_up = catch_up_s
                stale, behind = False, 0
            cost = costs[str(shape)]
            seconds += cost + refresh + catch_up
            steps += 1
            counts[str(shape)] = counts.get(str(shape), 0) + 1
            if ctl:  # a refresh is reported apart, as the engine's refresh_s
                ctl.observe(shape, float(emitted), cost, refresh_s=refresh, emitted=[emitted])
            p += emitted
    return seconds, steps, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--costs-from", default="results/e2e-depths3-h100-20261124.json")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--data-dir", default=".data")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--refresh-ms", type=float, default=1.0)
    ap.add_argument("--catch-up-ms", type=float, default=0.05)
    ap.add_argument("--alpha", type=float, nargs="*", default=[],
                    help="also replay goodput control with these running-mean weights (beside the default)")
    args = ap.parse_args()
    rows = json.load(open(args.costs_from))["rows"]
    table = next(r["goodput"] for r in rows if r["method"] == "auto" and r["prompt_set"] == args.prompt_set
                 and r["temperature"] == 0)
    costs = {g["shape"]: g["cost_ms"] / 1e3 for g in table if not g["sampled"] and g["shape"].startswith(("none", "chain"))}
    shapes = [TreeShape.parse(s) for s in costs]
    depth = max(s.max_depth for s in shapes)
    trace = traces(args.prompt_set, args.num_prompts, args.max_new_tokens, depth, args.data_dir)
    lines = [f"goodput replay: {args.prompt_set}, {args.num_prompts} prompts x {args.max_new_tokens} tokens, greedy, "
             f"costs from {args.costs_from} (ms: {', '.join(f'{k} {1e3 * v:.3f}' for k, v in costs.items())}), "
             f"refresh {args.refresh_ms} ms, catch-up {args.catch_up_ms} ms",
             f"{'policy':12s} {'tok/s':>8s} {'x plain':>8s} {'tau':>6s}  steps per shape"]
    plain_rate = None
    policies = [(str(s), s) for s in shapes]
    knobs = dict(explore_budget=EXPLORE_BUDGET, explore_window=EXPLORE_WINDOW)
    policies.append(("auto", GoodputController(shapes, **knobs)))
    policies += [(f"auto a={a:g}", GoodputController(shapes, alpha=a, **knobs)) for a in args.alpha]
    for name, policy in policies:
        if isinstance(policy, GoodputController):
            for s in shapes:
                policy.prime(s, False, cost=costs[str(s)])
        seconds, steps, counts = replay(trace, policy, costs, args.refresh_ms / 1e3, args.catch_up_ms / 1e3,
                                        args.max_new_tokens)
        tokens = args.num_prompts * args.max_new_tokens
        rate = tokens / seconds
        plain_rate = plain_rate or rate
        lines.append(f"{name:12s} {rate:8.0f} {rate / plain_rate:8.3f} {tokens / steps:6.2f}  {counts}")
    every = [a for t in trace for a in t]
    lines.append("mean tau over every position, chain:K: " + ", ".join(
        f"{k} {1 + sum(min(a, k) for a in every) / len(every):.2f}" for k in range(1, depth + 1)))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
