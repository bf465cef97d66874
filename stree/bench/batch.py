"""``stree bench batch``: throughput of the batched engine at batch 1, 4, 16, 64, speculative vs plain.

Two targets: the trained demo pair with its real draft model (HumanEval prompts; ``plain``,
``auto`` = goodput choice among plain/chains/trees, and a fixed tree), and, on a GPU, the
Mamba2-2.7B shape with random weights and the oracle drafter (right for exactly tau-1 levels),
where the plain run's own greedy output is the oracle's continuation. Every run is timed after
a warm-up run of the same shape (graph captures happen there); the host time per step is the
engine's launch + bookkeeping time, excluding waits for the GPU.
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from stree.bench.common import add_device_args, add_pair_args, cuda_sync, device_and_dtype, record_meta, report
from stree.bench.oracle import SHAPES, greedy_refresher, make_target
from stree.bench.prompt_sets import load_prompt_set
from stree.drafter_service.drafters.oracle import OracleDrafter
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.protocols.registry import create_drafter
from stree.verifier.decode.loop import generate
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.tokenizer import load_tokenizer


def timed(model, prompts, drafter, batch: int, new_tokens: int, temperature: float, **opts) -> dict:
    """Tokens/s of ``prompts`` run ``batch`` at a time (after one warm-up run of the same call)."""
    kw = dict(drafter=drafter, max_new_tokens=new_tokens, temperature=temperature, seed=0, max_batch=batch, **opts)
    generate(model, prompts[:batch], **kw)
    cuda_sync()
    t0 = time.perf_counter()
    outs = generate(model, prompts, **kw)
    cuda_sync()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats["steps"] for o in outs)
    return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
            "tau": tokens / steps if steps else None, "host_us_p50": outs[0].stats.get("host_us_p50"),
            "outputs": [o.token_ids for o in outs],
            "goodput": outs[0].stats.get("goodput")}


def pair_rows(args, device, dtype) -> list[dict]:
    target = load_model(args.target, device=device, dtype=dtype)
    draft = load_model(args.draft, device=device, dtype=dtype)
    tok = load_tokenizer(args.target)
    texts = load_prompt_set("humaneval", max(args.batch_sizes), None, None)
    prompts = [tok.encode(t, add_special_tokens=False).ids[-args.max_prompt_tokens:] or [0] for _, t in texts]
    rows = []
    methods = {"plain": (None, {}), "auto": ("mamba", {"draft_model": draft, "tree": "auto"}),
               "beam": ("mamba", {"draft_model": draft, "tree": args.beam_tree})}
    for temp in args.temperatures:
        for b in tqdm(args.batch_sizes, desc=f"pair T={temp}", file=sys.stderr):
            plain = None
            for name, (d, opts) in methods.items():
                drafter = create_drafter(d, **opts) if d else None
                res = timed(target, prompts[:b], drafter, b, args.max_new_tokens, temp)
                outs = res.pop("outputs")
                row = dict(target="demo-pair", method=name, batch=b, temperature=temp, **res)
                if name == "plain":
                    plain = row
                else:
                    row["speedup_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                    if temp == 0:
                        row["output_equals_plain_greedy"] = outs == plain_outs
                if name == "plain":
                    plain_outs = outs
                rows.append(row)
    return rows


def oracle_rows(args, device, dtype) -> list[dict]:
    shape = SHAPES[args.oracle_shape]
    model = make_target(args.oracle_shape, device, dtype)
    g = torch.Generator().manual_seed(0)
    rows = []
    k = args.oracle_tau - 1
    # bf16 tree passes and decode steps round differently, so a batched run soon leaves the plain run's
    # continuation; the oracle then asks the target for its greedy continuation from there (untimed)
    refresh = greedy_refresher(model, 64, args.oracle_prompt_len + 2 * args.oracle_new_tokens + 64)
    for b in tqdm(args.batch_sizes, desc=f"oracle {args.oracle_shape}", file=sys.stderr):
        prompts = [torch.randint(0, shape["vocab_size"], (args.oracle_prompt_len,), generator=g).tolist()
                   for _ in range(b)]
        n = args.oracle_new_tokens
        plain = timed(model, prompts, None, b, n + k + 1, 0.0)
        conts = plain.pop("outputs")
        plain.update(tokens_per_s=plain["tokens_per_s"])
        rows.append(dict(target=args.oracle_shape, method="plain", batch=b, temperature=0.0, **plain))
        for nodes in (k + 2, args.oracle_nodes):
            sessions = [OracleDrafter(p, c, shape["vocab_size"], k, nodes, seed=i, refresh=refresh)
                        for i, (p, c) in enumerate(zip(prompts, conts))]
            spec = _timed_oracle(model, prompts, sessions, b, n)
            rows.append(dict(target=args.oracle_shape, method=f"oracle-{'chain' if nodes == k + 2 else nodes}",
                             nodes=nodes, batch=b, temperature=0.0, target_tau=args.oracle_tau, **spec,
                             speedup_vs_plain=spec["tokens_per_s"] / plain["tokens_per_s"]))
    return rows


def _timed_oracle(model, prompts, drafters, batch: int, new_tokens: int) -> dict:
    """One oracle drafter per prompt: the engine's host-drafter path, all prompts in one batch.

    The drafters' continuation refreshes (target passes of their own) are taken out of the time.
    """
    from stree.protocols.sampling import SamplingParams
    from stree.verifier.decode.engine import Request
    from stree.verifier.decode.loop import engine_for

    best = None
    for _ in range(2):  # the first run captures the graphs
        engine = engine_for(model, "host", (), batch, max(len(p) for p in prompts) + new_tokens, None, DEFAULT_BUDGET)
        reqs = [Request(p, new_tokens, SamplingParams(), drafter_session=d.open(p, SamplingParams()))
                for p, d in zip(prompts, drafters)]
        for d in drafters:
            d.refresh_s, d.refreshes = 0.0, 0
        cuda_sync()
        t0 = time.perf_counter()
        engine.run(reqs)
        cuda_sync()
        elapsed = time.perf_counter() - t0 - sum(d.refresh_s for d in drafters)
        tokens = sum(len(r.output) for r in reqs)
        steps = sum(r.steps for r in reqs)
        res = {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed, "tau": tokens / steps,
               "continuation_refreshes": sum(d.refreshes for d in drafters),
               **engine.host_step_stats}
        if best is None or res["tokens_per_s"] > best["tokens_per_s"]:
            best = res
    return best


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    rows = pair_rows(args, device, dtype)
    if args.oracle_shape:
        rows += oracle_rows(args, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    record = {**record_meta("batch", device), "dtype": args.dtype, "torch": torch.__version__, "rows": rows}
    header = f"{'target':<10}{'method':<14}{'T':>4}{'batch':>6}{'tok/s':>10}{'x plain':>9}{'tau':>6}{'host us':>9}"
    return report(record, args.out, header, _table_line)


def _table_line(r: dict) -> str:
    sp = r.get("speedup_vs_plain")
    return (f"{r['target']:<10}{r['method']:<14}{r['temperature']:>4}{r['batch']:>6}{r['tokens_per_s']:>10.0f}"
            f"{(f'{sp:.2f}x' if sp else '-'):>9}{(r.get('tau') or 0):>6.2f}{(r.get('host_us_p50') or 0):>9.0f}")


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="engine throughput at several batch sizes: speculative (auto, tree) vs plain")
    add_pair_args(p)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--beam-tree", default="beam:5x3")
    p.add_argument("--oracle-shape", default=None, choices=list(SHAPES), help="also the oracle at this random shape")
    p.add_argument("--oracle-tau", type=int, default=4)
    p.add_argument("--oracle-nodes", type=int, default=16)
    p.add_argument("--oracle-prompt-len", type=int, default=64)
    p.add_argument("--oracle-new-tokens", type=int, default=128)
    add_device_args(p, "float32")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
