"""``stree bench batch``: throughput of the batched engine at batch 1, 4, 16, 64, speculative vs plain.

Two targets: the trained demo pair with its real draft model (HumanEval prompts; ``plain``,
``auto`` = goodput choice among plain/chains/trees, and a fixed tree), and, on a GPU, the
Mamba2-2.7B shape with random weights and the device oracle drafter (right for exactly tau-1
levels of the target's own output, written by ``SelfOracleDrafter`` on the oracle's tree so that it
holds in bf16 too; ``auto`` rows use plain greedy output, see ``settle_oracle``), beside mamba_ssm's
graphed decode at the same batch size. Every run is timed after
a warm-up run of the same shape (graph captures happen there); the host time per step is the
engine's launch + bookkeeping time, excluding waits for the GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.bench.common import (DEMO_TARGET, add_device_args, add_pair_args, cuda_sync, device_and_dtype, record_meta,
                                report)
from stree.bench.oracle import SHAPES, make_target
from stree.bench.prompt_sets import PROMPT_SETS, load_prompt_set
from stree.drafter_service.drafters.oracle_device import OracleDeviceDrafter
from stree.drafter_service.drafters.oracle_self import SelfOracleDrafter
from stree.protocols.registry import create_drafter
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS
from stree.verifier.decode.loop import generate, release_engines, warm_up_engines
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.lm import SSM_CACHE_DTYPES
from stree.verifier.model.tokenizer import load_tokenizer


RUN_METRICS = ("steps:", "drain_", "drafter_", "refresh_", "admission_", "admit_")
"""The engine metrics recorded for every timed run (``engine_runs``), by name prefix."""


class TimedCall:
    """One ``generate`` call timed run after run: made with one warm-up run of the same call (so the measured
    runs neither resize the cached engine, capture a graph nor compile a kernel: steady state)."""

    def __init__(self, model, prompts, drafter, batch: int, new_tokens: int, temperature: float, **opts):
        self.model, self.prompts = model, prompts
        self.kw = dict(drafter=drafter, max_new_tokens=new_tokens, temperature=temperature, seed=0, max_batch=batch,
                       **opts)
        first = generate(model, prompts, **self.kw)
        if warm_up_engines(model):  # goodput control: capture every step path its later choices may take
            first = generate(model, prompts, **self.kw)
        self.before = first[0].stats["engine_metrics"]
        self.runs: list = []  # (seconds, outputs, the run's engine metrics)

    def run(self) -> None:
        cuda_sync()
        t0 = time.perf_counter()
        outs = generate(self.model, self.prompts, **self.kw)
        cuda_sync()
        after = outs[0].stats["engine_metrics"]
        self.runs.append((time.perf_counter() - t0, outs, {k: v - self.before.get(k, 0) for k, v in after.items()}))
        self.before = after

    def result(self) -> dict:
        """The median run (tokens/s, engine metrics, outputs), and every run's tokens/s beside it."""
        runs = self.runs
        elapsed, outs, engine = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.stats["steps"] for o in outs)
        return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
                "tokens_per_s_runs": [tokens / e for e, _, _ in runs],
                "engine": engine,  # the median run's engine metrics: steps and GPU seconds per shape, admission, refresh
                # every run's steps per shape, drafter refreshes and admission holds: what made a slow run slow
                "engine_runs": [{k: v for k, v in m.items() if k.startswith(RUN_METRICS)} for _, _, m in runs],
                "tau": tokens / steps if steps else None, "host_us_p50": outs[0].stats.get("host_us_p50"),
                "outputs": [o.token_ids for o in outs],
                "goodput": outs[0].stats.get("goodput")}


def timed(model, prompts, drafter, batch: int, new_tokens: int, temperature: float, repeats: int = 1,
          **opts) -> dict:
    """Tokens/s of ``prompts`` run ``batch`` at a time (``TimedCall``); with ``repeats`` > 1 the median run is
    reported, and every run's tokens/s beside it."""
    call = TimedCall(model, prompts, drafter, batch, new_tokens, temperature, **opts)
    for _ in range(max(1, repeats)):
        call.run()
    return call.result()


def pair_name(target) -> str:
    """A pair's row label: ``demo-pair`` for the demo checkpoints, else the target folder's (or Hub id's) name."""
    return "demo-pair" if str(target) == str(DEMO_TARGET) else Path(str(target)).name


def pair_rows(args, device, dtype) -> list[dict]:
    target = load_model(args.target, device=device, dtype=dtype)
    draft = load_model(args.draft, device=device, dtype=dtype)
    tok = load_tokenizer(args.target)
    texts = load_prompt_set(args.prompt_set, max(max(args.batch_sizes), args.min_prompts), args.prompt_file,
                            args.data_dir)
    prompts = [tok.encode(t, add_special_tokens=False).ids[-args.max_prompt_tokens:] or [0] for _, t in texts]
    rows = []
    methods = {"plain": (None, {}), "auto": ("mamba", {"draft_model": draft, "tree": "auto"}),
               "beam": ("mamba", {"draft_model": draft, "tree": args.beam_tree})}
    # one drafter per method for every row, as one server keeps one: each batch size gets its own engine, which
    # starts from the acceptance the previous engine over that drafter measured (Engine.inherit_acceptance)
    drafters = {name: create_drafter(d, **opts) if d else None for name, (d, opts) in methods.items()}
    for temp in args.temperatures:
        for b in tqdm(args.batch_sizes, desc=f"pair T={temp}", file=sys.stderr):
            plain = None
            variants = [(name, hold) for name in methods for hold in ([None] if name == "plain" else args.admit_hold_steps)]
            # at least --min-prompts prompts, b at a time (later ones join as slots free up)
            calls = {v: TimedCall(target, prompts[:max(b, args.min_prompts)], drafters[v[0]], b, args.max_new_tokens,
                                  temp, admit_hold_steps=v[1]) for v in variants}
            for _ in range(max(1, args.repeats)):  # interleaved: a drift of the machine reaches every method alike
                for call in calls.values():
                    call.run()
            for (name, hold), call in calls.items():
                res = call.result()
                outs = res.pop("outputs")
                row = dict(target=pair_name(args.target), method=name, batch=b, temperature=temp,
                           admit_hold_steps=ADMIT_HOLD_STEPS if hold is None else hold, **res)
                if name == "plain":
                    plain, plain_outs = row, outs
                else:
                    row["speedup_vs_plain"] = row["tokens_per_s"] / plain["tokens_per_s"]
                    if temp == 0:
                        row["output_equals_plain_greedy"] = outs == plain_outs
                rows.append(row)
    return rows


def oracle_rows(args, device, dtype) -> list[dict]:
    """The random-weight target with the device oracle (right for tau - 1 levels) at each batch size, against
    plain decoding and mamba_ssm's graphed decode at the same batch size."""
    from stree.bench.kernels import mamba_ssm_decode_ms

    shape = SHAPES[args.oracle_shape]
    model = make_target(args.oracle_shape, device, dtype)
    model.set_mamba_ssm_cache_dtype(args.oracle_mamba_ssm_cache_dtype)
    g = torch.Generator().manual_seed(0)
    rows = []
    k, n = args.oracle_tau - 1, args.oracle_new_tokens
    rates, replay = None, {}
    if args.oracle_accept:
        rates = recorded_accept_rates(args.oracle_accept)
        k = len(rates)
        replay = dict(accept_rates=rates, accept_from=args.oracle_accept,
                      note="acceptance replayed from a recorded run; the drafter's own cost is not included")
    trees = {"oracle-chain": [f"chain:{k + 1}"], f"oracle-{args.oracle_tree}": [args.oracle_tree],
             "oracle-auto": ["none", f"chain:{k + 1}", args.oracle_tree]}
    for b in tqdm(args.batch_sizes, desc=f"oracle {args.oracle_shape}", file=sys.stderr):
        prompts = [torch.randint(0, shape["vocab_size"], (args.oracle_prompt_len,), generator=g).tolist()
                   for _ in range(b)]
        reset_peak_memory(device)
        plain = timed(model, prompts, None, b, n + k + 1, 0.0)
        conts = plain.pop("outputs")
        prefill_s = timed(model, prompts, None, b, 1, 0.0)["elapsed_s"]  # admission (prefill) + one step
        plain["gpu_peak_gib"] = peak_memory_gib(device)
        release_engines(model)  # one engine's SSM state is 10 GiB at batch 64: keep one alive at a time

        def decode_rate(res: dict) -> float:
            """Tokens/s after admission: mamba_ssm's anchor is a decode step, so prefill is left out of both."""
            return (res["tokens"] - b) / max(res["elapsed_s"] - prefill_s, 1e-9)

        plain["decode_tokens_per_s"] = decode_rate(plain)
        ref_ms = None
        if device.type == "cuda":
            ref_ms = mamba_ssm_decode_ms(dict(d_model=shape["d_model"], n_layer=shape["n_layer"]), dtype,
                                         shape["vocab_size"], args.oracle_prompt_len, batch=b)
        ref_tps = b * 1e3 / ref_ms if ref_ms else None
        if ref_tps:
            rows.append(dict(target=args.oracle_shape, method="mamba_ssm", batch=b, temperature=0.0,
                             tokens_per_s=ref_tps, decode_tokens_per_s=ref_tps, ms_per_step=ref_ms,
                             note="graphed MambaLMHeadModel one-token step, no sampling or host work"))
        rows.append(dict(target=args.oracle_shape, method="plain", batch=b, temperature=0.0, **plain,
                         prefill_and_first_step_s=prefill_s,
                         speedup_vs_mamba_ssm=plain["decode_tokens_per_s"] / ref_tps if ref_tps else None))
        for name, shapes in trees.items():
            reset_peak_memory(device)
            oracle = OracleDeviceDrafter(shape["vocab_size"], k, shapes, device, accept_rates=rates)
            if len(shapes) == 1:  # one tree: the target drafting for itself on it writes the continuation
                made = generate(model, prompts, drafter=SelfOracleDrafter(model, shapes[0], k),
                                max_new_tokens=n + k + 1, max_batch=b)
                release_engines(model)
                for p, o in zip(prompts, made):
                    oracle.set_continuation(p, o.token_ids)
                rounds = 0
            else:  # auto mixes plain steps and trees: no one continuation fits every choice in bf16
                rounds = settle_oracle(model, prompts, conts, oracle, b, args.oracle_settle_rounds)
            spec = timed(model, prompts, oracle, b, n, 0.0)
            release_engines(model)
            spec["gpu_peak_gib"] = peak_memory_gib(device)
            outs = spec.pop("outputs")
            spec["decode_tokens_per_s"] = decode_rate(spec)
            rows.append(dict(target=args.oracle_shape, method=name, batch=b, temperature=0.0,
                             target_tau=1 + sum(rates) if rates else k + 1, settle_rounds=rounds, **replay, **spec,
                             followed_continuation=sum(o == oracle.continuation(p)[:n]
                                                       for p, o in zip(prompts, outs)) / b,
                             speedup_vs_plain=spec["tokens_per_s"] / plain["tokens_per_s"],
                             speedup_vs_mamba_ssm=spec["decode_tokens_per_s"] / ref_tps if ref_tps else None))
    return rows


def recorded_accept_rates(spec: str) -> list[float]:
    """``RECORD.json:METHOD`` -> the chance that a draft of METHOD was right to depth 1, 2, ... in that e2e record
    (its greedy rows, every prompt set: ``accepted_per_depth`` over the steps)."""
    path, sep, method = spec.rpartition(":")
    if not sep or not path or not method:
        raise ValueError(f"--oracle-accept must be RECORD.json:METHOD, got {spec!r}")
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--oracle-accept: {path} is not a readable JSON record ({exc})") from exc
    rows = [r for r in record.get("rows", []) if r.get("method") == method and r.get("temperature") == 0.0
            and r.get("accepted_per_depth")]
    if not rows:
        raise ValueError(f"--oracle-accept: {path} has no greedy {method!r} rows with accepted_per_depth")
    steps = sum(r["steps"] for r in rows)
    counts = [0] * max(len(r["accepted_per_depth"]) for r in rows)
    for r in rows:
        for d, c in enumerate(r["accepted_per_depth"]):
            counts[d] += c
    rates = [min(1.0, c / steps) for c in counts]
    return [min(rates[: d + 1]) for d in range(len(rates))]  # non-increasing, as chances of reaching a depth are


def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device) -> float | None:
    """The most GPU memory allocated since ``reset_peak_memory`` (GiB; None on the CPU): recorded per row, since
    at the 2.7B shape and batch 64 one engine's state is 10 GiB."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def settle_oracle(model, prompts, conts, oracle, batch: int, rounds: int) -> int:
    """Register ``conts`` with the oracle, then let it follow what the speculative run itself generates
    (the ``auto`` rows only: a fixed tree gets its continuation from ``SelfOracleDrafter``).

    In bf16 a tree pass and a one-token step round differently, so near-ties can make the speculative
    output leave plain decoding's continuation; the oracle would then be wrong from there on. Each
    round runs the batch with the oracle and, where the output left the registered continuation,
    registers the output instead. In fp32 nothing changes (outputs equal plain greedy). In bf16 on a
    random target without planted successors it need not converge: a round moves the step boundaries,
    so later tokens are scored at other tree depths and flip again; the bench records how many outputs
    followed (``followed_continuation``). Returns the rounds that changed something.
    """
    for p, c in zip(prompts, conts):
        oracle.set_continuation(p, c)
    length = len(conts[0])
    for r in range(rounds):
        outs = generate(model, prompts, drafter=oracle, max_new_tokens=length, max_batch=batch)
        changed = False
        for p, o in zip(prompts, outs):
            if o.token_ids != oracle.continuation(p):
                oracle.set_continuation(p, o.token_ids)
                changed = True
        if not changed:
            return r
    return rounds


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    rows = [] if args.skip_pair else pair_rows(args, device, dtype)
    if args.oracle_shape:
        rows += oracle_rows(args, device, getattr(torch, args.oracle_dtype) if device.type == "cuda" else torch.float32)
    from stree.bench.kernels import package_version

    record = {**record_meta("batch", device), "dtype": args.dtype,
              "oracle_dtype": args.oracle_dtype if args.oracle_shape else None,
              "oracle_mamba_ssm_cache_dtype": args.oracle_mamba_ssm_cache_dtype if args.oracle_shape else None,
              "torch": torch.__version__,
              "mamba_ssm": package_version("mamba_ssm"), "causal_conv1d": package_version("causal_conv1d"),
              "rows": rows}
    header = (f"{'target':<10}{'method':<22}{'T':>4}{'batch':>6}{'tok/s':>10}{'decode':>9}{'x plain':>9}{'x mamba_ssm':>12}"
              f"{'tau':>6}{'host us':>9}")
    return report(record, args.out, header, _table_line)


def _table_line(r: dict) -> str:
    sp, sm = r.get("speedup_vs_plain"), r.get("speedup_vs_mamba_ssm")
    dec = r.get("decode_tokens_per_s")
    method = r["method"] if r["method"] == "plain" or "admit_hold_steps" not in r else \
        f"{r['method']} hold {r['admit_hold_steps']}"
    return (f"{r['target']:<10}{method:<22}{r['temperature']:>4}{r['batch']:>6}{r['tokens_per_s']:>10.0f}"
            f"{(f'{dec:.0f}' if dec else '-'):>9}{(f'{sp:.2f}x' if sp else '-'):>9}{(f'{sm:.2f}x' if sm else '-'):>12}{(r.get('tau') or 0):>6.2f}"
            f"{(r.get('host_us_p50') or 0):>9.0f}")


def add_parser(sub) -> None:
    p = sub.add_parser("batch", help="engine throughput at several batch sizes: speculative (auto, tree) vs plain")
    add_pair_args(p)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-prompts", type=int, default=8,
                   help="trained pair: run at least this many prompts per batch size (small batches run several waves)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--prompt-set", default="humaneval", choices=PROMPT_SETS, help="trained pair: the prompts' set")
    p.add_argument("--prompt-file", default=None,
                   help="the jsonl file of --prompt-set (mt_bench, gsm8k, spec_bench), or in_domain's site-packages")
    p.add_argument("--data-dir", default=None, help="folder with mt_bench/, gsm8k/, spec_bench/ (e.g. ../shared/data)")
    p.add_argument("--repeats", type=int, default=3,
                   help="trained pair: measured runs per row after the warm-up; the median is reported")
    p.add_argument("--beam-tree", default="beam:5x3")
    p.add_argument("--admit-hold-steps", type=lambda s: [int(x) for x in s.split(",")], default=[ADMIT_HOLD_STEPS],
                   help="speculative pair rows once per value: steps free slots may wait to batch queued prompts")
    p.add_argument("--skip-pair", action="store_true", help="only the oracle rows (with --oracle-shape)")
    p.add_argument("--oracle-shape", default=None, choices=list(SHAPES), help="also the oracle at this random shape")
    p.add_argument("--oracle-tau", type=int, default=4)
    p.add_argument("--oracle-accept", default=None, metavar="RECORD.json:METHOD",
                   help="replay the acceptance by depth METHOD had in an e2e record (instead of --oracle-tau): "
                        "a projection of that drafter's acceptance at this shape, its drafting cost left out")
    p.add_argument("--oracle-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the random target's dtype on a GPU (fp32: no bf16 near-ties between tree pass and step)")
    p.add_argument("--oracle-mamba-ssm-cache-dtype", choices=SSM_CACHE_DTYPES, default="float32",
                   help="the random target's SSM state dtype (auto: the model's, as mamba_ssm keeps it)")
    p.add_argument("--oracle-tree", default="static:2,2,1,1", help="the oracle's tree besides the chain")
    p.add_argument("--oracle-settle-rounds", type=int, default=4,
                   help="auto rows: rounds letting the oracle follow the speculative run's own bf16 output "
                        "(see settle_oracle)")
    p.add_argument("--oracle-prompt-len", type=int, default=64)
    p.add_argument("--oracle-new-tokens", type=int, default=128)
    add_device_args(p, "float32")
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
