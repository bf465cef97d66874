"""``stree demo``: the main job on an embedded default — speculative vs plain decoding, side by side.

Uses the trained demo pair under ``checkpoints/`` when it is there; otherwise writes a small random
hybrid target and Mamba2 draft to a cache folder (acceptance is then low: random models disagree).
Every method runs several times, interleaved, and reports its median tokens/s; the demo says when the runs
spread too much to compare. Every speculative output is checked token for token against plain greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stree.cli.timing import NOISE_LIMIT, noise_warning, noisy, time_interleaved
from stree.verifier.model.checkpoint import init_model, load_model
from stree.verifier.decode.loop import generate
from stree.verifier.model.tokenizer import load_tokenizer

REPO_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"  # stree/cli/demo.py -> the repo root
CACHE = Path.home() / ".cache" / "stree" / "demo"
DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
METHODS = [
    ("plain", None, {}),
    ("chain (vanilla SD)", "chain", {}),
    ("static tree 3,1,1,1", "static-tree", {}),
    ("beam tree 4x3", "mamba", {"tree": "beam:4x3"}),
    ("n-gram", "ngram", {}),
]


def demo_pair() -> tuple[Path, Path, str]:
    """(target dir, draft dir, description) of the pair the demo runs on."""
    target, draft = REPO_CHECKPOINTS / "demo-target", REPO_CHECKPOINTS / "demo-draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft, "trained demo pair (checkpoints/)"
    target, draft = CACHE / "target", CACHE / "draft"
    if not (target / "config.json").exists():
        init_model(target, arch="hybrid", d_model=128, n_layer=4, attn_layers=[2], vocab_size=512, seed=1,
                   d_state=32, headdim=32)
    if not (draft / "config.json").exists():
        init_model(draft, arch="mamba2", d_model=64, n_layer=2, vocab_size=512, seed=2, d_state=16, headdim=16)
    return target, draft, "random models (no trained pair found under checkpoints/)"


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if (args.target is None) != (args.draft is None):
        raise ValueError("--target and --draft go together")
    target_dir, draft_dir, what = (demo_pair() if args.target is None
                                   else (Path(args.target), Path(args.draft), f"{args.target} drafted by {args.draft}"))
    target, draft = load_model(target_dir, device=device), load_model(draft_dir, device=device)
    tok = load_tokenizer(target_dir)
    prompt = tok.encode(args.prompt).ids
    print(f"stree demo on {device}: {what}\nprompt: {args.prompt!r} ({len(prompt)} tokens)\n"
          f"each method: median of {args.runs} runs of {args.max_new_tokens} tokens, interleaved")

    def call(drafter, opts):
        return lambda n: generate(target, prompt, drafter=drafter, draft_model=draft, max_new_tokens=n,
                                  tokenizer=tok, **opts)

    timed = time_interleaved({name: call(drafter, opts) for name, drafter, opts in METHODS}, args.runs,
                             args.max_new_tokens)
    base = timed["plain"]
    rows = [{"method": name, "tokens_per_s": t.median, "tokens_per_s_runs": t.tokens_per_s, "spread": t.spread,
             "speedup": t.median / base.median, "mean_accepted_length": t.result.stats["mean_accepted_length"],
             "identical_to_plain": t.result.token_ids == base.result.token_ids} for name, t in timed.items()]
    print(f"\n{'method':<22}{'tok/s':>9}{'spread':>8}{'speedup':>9}{'τ':>7}  same output")
    for r in rows:
        print(f"{r['method']:<22}{r['tokens_per_s']:>9.1f}{100 * r['spread']:>7.0f}%{r['speedup']:>8.2f}x"
              f"{r['mean_accepted_length']:>7.2f}  {'yes' if r['identical_to_plain'] else 'NO'}")
    loud = noisy(timed, args.noise_limit)
    if loud:
        print("\n" + noise_warning(loud, timed, args.noise_limit))
    print("\ngenerated:", repr(base.result.text))
    if args.json:
        print(json.dumps({"rows": rows, "runs": args.runs, "too_noisy_to_compare": bool(loud)}))
    return 0 if all(r["identical_to_plain"] for r in rows) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run speculative vs plain decoding on the embedded default pair")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--target", metavar="DIR", help="another target than the embedded demo pair's (with --draft)")
    p.add_argument("--draft", metavar="DIR", help="its Mamba2 draft model (same vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5, help="timed runs per method; the median is reported")
    p.add_argument("--noise-limit", type=float, default=NOISE_LIMIT,
                   help="say the machine is too noisy when a method's runs spread more than this fraction")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON object too")
    p.set_defaults(func=run)
