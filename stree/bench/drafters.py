"""``stree bench drafters``: draft time per step for each drafter and tree shape (JSON + table).

The draft model has Mamba2-130M's shape (d_model 768, 24 layers, d_state 128, headdim 64) with
random weights unless ``--draft-model`` names a checkpoint. The context repeats a random 64-token
motif (so the n-gram drafter finds matches); each step drafts under the budget, then commits the
motif's next tokens, so sessions advance as in generation.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from tqdm import tqdm

from stree.bench.common import add_device_args, cuda_sync, device_and_dtype, record_meta, report
from stree.protocols.drafter import DraftBudget
from stree.protocols.registry import create_drafter
from stree.protocols.sampling import SamplingParams
from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.hub import model_folder_arg
from stree.verifier.model.lm import StreeLM

MAMBA2_130M = dict(d_model=768, n_layer=24, vocab_size=50280,
                   ssm_cfg={"layer": "Mamba2", "d_state": 128, "headdim": 64, "expand": 2})

CASES = [
    ("mamba", {"tree": "chain:4"}),
    ("mamba", {"tree": "static:3,1,1,1"}),
    ("mamba", {"tree": "static:3,2,2,1"}),
    ("mamba", {"tree": "beam:4x3"}),
    ("mamba", {"tree": "dynamic:32"}),
    ("ngram", {}),
    ("fusion:mamba+ngram", {"tree": "beam:4x3"}),
]


def bench_one(name, options, draft_model, motif, context_len, budget, steps, params) -> dict:
    """Draft ``steps`` times on a context that repeats ``motif``; each step commits the motif's next tokens."""
    drafter = create_drafter(name, draft_model=draft_model, **options)
    stream = lambda i: motif[i % len(motif)]  # noqa: E731
    pos = context_len
    session = drafter.open([stream(i) for i in range(pos)], params)
    times, nodes = [], []
    for i in range(steps + 3):
        cuda_sync()
        t0 = time.perf_counter()
        tree = session.draft(budget)
        cuda_sync()
        if i >= 3:  # the first steps warm up kernels and caches
            times.append(time.perf_counter() - t0)
            nodes.append(tree.num_nodes)
        advance = 1 + tree.max_depth // 2  # as if half the drafted depth was accepted, plus the bonus
        session.commit([stream(pos + k) for k in range(advance)])
        pos += advance
    session.close()
    times.sort()
    return {
        "drafter": name, "options": options, "mean_nodes": statistics.mean(nodes),
        "draft_ms_p50": 1e3 * times[len(times) // 2], "draft_ms_p90": 1e3 * times[int(len(times) * 0.9)],
    }


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    if args.draft_model:
        from stree.verifier.model.checkpoint import load_model

        draft = load_model(args.draft_model, device=device, dtype=dtype)
    else:
        draft = random_init_(StreeLM(ModelConfig(**MAMBA2_130M)), 0).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(0, draft.vocab_size, (64,), generator=g).tolist()  # repeated: n-gram finds matches
    budget = DraftBudget(max_nodes=args.max_nodes, max_depth=8, max_width=4)
    params = SamplingParams(temperature=0.0)
    rows = [bench_one(n, o, draft, motif, args.context_len, budget, args.steps, params)
            for n, o in tqdm(CASES, desc="drafters")]
    record = {**record_meta("drafters", device),
              "draft_model": args.draft_model or "Mamba2-130M shape, random weights", "dtype": args.dtype,
              "context_len": args.context_len, "budget": vars(budget), "rows": rows}
    return report(record, args.out, f"{'drafter':<22}{'options':<26}{'nodes':>7}{'p50 ms':>9}{'p90 ms':>9}",
                  lambda r: f"{r['drafter']:<22}{json.dumps(r['options']):<26}{r['mean_nodes']:>7.1f}"
                            f"{r['draft_ms_p50']:>9.3f}{r['draft_ms_p90']:>9.3f}")


def add_parser(sub) -> None:
    p = sub.add_parser("drafters", help="draft time per step for each drafter and tree shape")
    p.add_argument("--draft-model", default=None, type=model_folder_arg,
                   help="checkpoint folder or Hub id (default: Mamba2-130M shape, random)")
    add_device_args(p, "bfloat16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--max-nodes", type=int, default=32)
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.set_defaults(func=run)
