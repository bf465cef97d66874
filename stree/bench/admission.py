"""``stree bench admission``: what prefilling joining sequences costs, eager passes vs CUDA-graph replays.

The engine admits requests (and refreshes a stale drafter) through ``PrefillRunner``; its eager
reference is ``prefill_contexts``. Both run here on the trained pair's target and draft model for a
few row counts and context lengths, wall time per call after a warm-up (graphs captured there).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from tqdm import tqdm

from stree.bench.common import add_device_args, add_pair_args, cuda_sync, device_and_dtype, record_meta, report
from stree.verifier.model.batch_prefill import prefill_contexts
from stree.verifier.decode.loop import engine_room
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.graphed_prefill import PrefillRunner


def _wall_ms(fn, reps: int) -> float:
    fn()
    cuda_sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cuda_sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def rows_for(name: str, model, args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in args.rows:
        for length in args.lengths:
            contexts = [torch.randint(0, model.vocab_size, (length,), generator=gen).tolist() for _ in range(rows)]
            runner = PrefillRunner(model, rows, engine_room(length + 1), chunk=args.chunk)
            graphed = _wall_ms(lambda: runner.run(contexts, lambda *_: None), args.reps)
            eager = _wall_ms(lambda: prefill_contexts(model, contexts, args.chunk), args.reps)
            out.append(dict(model=name, rows=rows, context=length, eager_ms=eager, graphed_ms=graphed,
                            speedup=eager / graphed, graphs=len(runner.graphs)))
    return out


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    rows = []
    for name, path in tqdm([("target", args.target), ("draft", args.draft)], desc="admission", file=sys.stderr):
        rows += rows_for(name, load_model(path, device=device, dtype=dtype), args)
    record = {**record_meta("admission", device), "dtype": args.dtype, "chunk": args.chunk, "rows": rows}
    header = f"{'model':<8}{'rows':>6}{'context':>9}{'eager ms':>10}{'graphed ms':>12}{'speedup':>9}"
    return report(record, args.out, header, lambda r: (
        f"{r['model']:<8}{r['rows']:>6}{r['context']:>9}{r['eager_ms']:>10.2f}{r['graphed_ms']:>12.2f}"
        f"{r['speedup']:>8.2f}x"))


def add_parser(sub) -> None:
    p = sub.add_parser("admission", help="prefill of joining sequences: eager passes vs the engine's graphed runner")
    add_pair_args(p)
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[100, 300, 1000])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    add_device_args(p, "float32")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
