"""``stree demo``: the main job on an embedded default — speculative vs plain decoding, side by side.

Uses the trained demo pair under ``checkpoints/`` when it is there; otherwise writes a small random
hybrid target and Mamba2 draft to a cache folder (acceptance is then low: random models disagree).
Every speculative run is checked token for token against plain greedy decoding.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from stree.verifier.model.checkpoint import init_model, load_model
from stree.verifier.decode.loop import generate
from stree.verifier.model.tokenizer import load_tokenizer

REPO_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"  # stree/cli/demo.py -> the repo root
CACHE = Path.home() / ".cache" / "stree" / "demo"
DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


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
    target_dir, draft_dir, what = demo_pair()
    target, draft = load_model(target_dir, device=device), load_model(draft_dir, device=device)
    tok = load_tokenizer(target_dir)
    prompt = tok.encode(args.prompt).ids
    print(f"stree demo on {device}: {what}\nprompt: {args.prompt!r} ({len(prompt)} tokens)")
    rows, base = [], None
    for name, drafter, opts in [
        ("plain", None, {}),
        ("chain (vanilla SD)", "chain", {}),
        ("static tree 3,1,1,1", "static-tree", {}),
        ("beam tree 4x3", "mamba", {"tree": "beam:4x3"}),
        ("n-gram", "ngram", {}),
    ]:
        generate(target, prompt, drafter=drafter, draft_model=draft, max_new_tokens=8, **opts)  # warm-up
        t0 = time.perf_counter()
        res = generate(target, prompt, drafter=drafter, draft_model=draft, max_new_tokens=args.max_new_tokens,
                       tokenizer=tok, **opts)
        elapsed = time.perf_counter() - t0
        if base is None:
            base = res
        same = res.token_ids == base.token_ids
        rows.append({"method": name, "tokens_per_s": len(res.token_ids) / elapsed,
                     "mean_accepted_length": res.stats["mean_accepted_length"], "identical_to_plain": same})
    plain_tps = rows[0]["tokens_per_s"]
    print(f"\n{'method':<22}{'tok/s':>9}{'speedup':>9}{'τ':>7}  same output")
    for r in rows:
        print(f"{r['method']:<22}{r['tokens_per_s']:>9.1f}{r['tokens_per_s'] / plain_tps:>8.2f}x"
              f"{r['mean_accepted_length']:>7.2f}  {'yes' if r['identical_to_plain'] else 'NO'}")
    print("\ngenerated:", repr(base.text))
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["identical_to_plain"] for r in rows) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run speculative vs plain decoding on the embedded default pair")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
