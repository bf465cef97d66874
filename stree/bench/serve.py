"""``stree bench serve``: replay a prompt set against a running server (HTTP or gRPC) under load.

For each request rate (Poisson arrivals; ``inf``: all at once) and concurrency cap it streams every
prompt and reports request and token throughput, TTFT, inter-token latency and end-to-end latency
percentiles, and the speculative acceptance the server reported; writes JSON and a PNG.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from stree.bench.prompt_sets import PROMPT_SETS, load_prompt_set


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list = field(default_factory=list)
    output_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    error: str = ""


def percentiles(xs: list[float]) -> dict:
    """mean, p50, p90, p99 (nearest rank) in milliseconds; empty input gives zeros."""
    if not xs:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    s = sorted(xs)

    def rank(q):
        return 1e3 * s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"mean_ms": 1e3 * sum(s) / len(s), "p50_ms": rank(0.5), "p90_ms": rank(0.9), "p99_ms": rank(0.99)}


# ----- one request per protocol ------------------------------------------------------------------
async def http_request(client, base: str, model: str, prompt: str, max_tokens: int, headers: dict) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    last, ttft, itls, usage = t0, None, [], {}
    async with client.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return Outcome(False, error=f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                return Outcome(False, error=msg["error"]["message"])
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices") and msg["choices"][0].get("token_ids"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    itls.append((now - last) / len(msg["choices"][0]["token_ids"]))
                last = now
    spec = usage.get("speculative", {})
    n = usage.get("completion_tokens", 0)
    steps = round(n / spec["mean_accepted_length"]) if spec.get("mean_accepted_length") else 0
    return Outcome(True, ttft or 0.0, time.perf_counter() - t0, itls, n, spec.get("drafted", 0),
                   spec.get("accepted", 0), steps)


async def grpc_request(stub, prompt: str, max_tokens: int) -> Outcome:
    from stree.proto.stree.v1 import generation_pb2

    req = generation_pb2.GenerateRequest(prompt_text=prompt, max_new_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    last, ttft, itls, stats = t0, None, [], None
    async for chunk in stub.Generate(req):
        if chunk.token_ids:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                itls.append((now - last) / len(chunk.token_ids))
            last = now
        if chunk.finished:
            stats = chunk.stats
    return Outcome(True, ttft or 0.0, time.perf_counter() - t0, itls, stats.generated_tokens, stats.draft_tokens,
                   stats.accepted_draft_tokens, stats.steps)


# ----- load ----------------------------------------------------------------------------------------
async def run_load(send, prompts: list[str], rate: float, concurrency: int, seed: int) -> tuple[list[Outcome], float]:
    """Send every prompt (Poisson arrivals at ``rate``/s, at most ``concurrency`` in flight)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> Outcome:
        async with gate:
            try:
                return await send(prompt)
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                return Outcome(False, error=repr(exc)[:200])

    t0 = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one(prompt)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    outcomes = list(await asyncio.gather(*tasks))
    return outcomes, time.perf_counter() - t0


def summarize(outcomes: list[Outcome], duration: float, rate: float, concurrency: int) -> dict:
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in ok)
    drafted, accepted, steps = (sum(o.drafted for o in ok), sum(o.accepted for o in ok), sum(o.steps for o in ok))
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "max_concurrency": concurrency,
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": tokens / duration if duration else 0.0, "output_tokens": tokens,
        "ttft": percentiles([o.ttft for o in ok]), "itl": percentiles([x for o in ok for x in o.itls]),
        "e2e": percentiles([o.e2e for o in ok]),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": tokens / steps if steps else 0.0,
    }


async def bench(url: str, prompts: list[str], rates: list[float], concurrencies: list[int], max_tokens: int,
                model: Optional[str], api_key: Optional[str], seed: int) -> list[dict]:
    rows = []
    if url.startswith("grpc://"):
        import grpc

        from stree.proto.stree.v1 import generation_pb2_grpc

        async with grpc.aio.insecure_channel(url[len("grpc://"):]) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for rate in rates:
                for conc in concurrencies:
                    outs, dur = await run_load(lambda p: grpc_request(stub, p, max_tokens), prompts, rate, conc, seed)
                    rows.append(summarize(outs, dur, rate, conc))
        return rows
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1024)) as client:
        if model is None:
            listed = (await client.get(f"{base}/v1/models", headers=headers)).json()
            model = listed["data"][0]["id"]
        for rate in rates:
            for conc in concurrencies:
                outs, dur = await run_load(lambda p: http_request(client, base, model, p, max_tokens, headers),
                                           prompts, rate, conc, seed)
                rows.append(summarize(outs, dur, rate, conc))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    thr = [r["output_token_throughput"] for r in rows]
    labels = [f"rate {r['request_rate']}, conc {r['max_concurrency']}" for r in rows]
    for ax, key in zip(axes, ("ttft", "itl", "e2e")):
        for q, marker in (("p50_ms", "o"), ("p99_ms", "^")):
            ax.plot(thr, [r[key][q] for r in rows], marker=marker, label=q[:-3])
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("stree bench serve: " + "; ".join(labels[:4]) + (" ..." if len(labels) > 4 else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rates(text: str) -> list[float]:
    out = [float(x) for x in text.split(",")]
    if any(not (r > 0) for r in out):
        raise ValueError(f"--request-rate values must be > 0 (or inf), got {text}")
    return out


def run(args) -> int:
    prompts = [text for _, text in load_prompt_set(args.prompt_set, args.num_prompts, args.prompt_file,
                                                   args.data_dir)]
    concurrencies = [int(x) for x in args.max_concurrency.split(",")]
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"--max-concurrency values must be >= 1, got {args.max_concurrency}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    rows = asyncio.run(bench(args.url, prompts, _rates(args.request_rate), concurrencies, args.max_tokens,
                             args.model, args.api_key, args.seed))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"url": args.url, "prompt_set": args.prompt_set, "num_prompts": len(prompts),
              "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "results": rows}
    (out / "serve_bench.json").write_text(json.dumps(record, indent=2))
    plot(rows, out / "serve_bench.png")
    for r in rows:
        print(f"rate {r['request_rate']:>5} conc {r['max_concurrency']:>4}: {r['completed']} ok, {r['failed']} failed, "
              f"{r['output_token_throughput']:.1f} tok/s, TTFT p50 {r['ttft']['p50_ms']:.1f} ms, "
              f"ITL p50 {r['itl']['p50_ms']:.2f} ms, e2e p50 {r['e2e']['p50_ms']:.1f} ms, "
              f"acceptance {r['acceptance_rate']:.2f}")
    print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test a running stree server (HTTP or gRPC)",
                       description="Replay a prompt set against a running `stree serve` at given request rates "
                                   "and concurrencies; report throughput, TTFT, ITL, e2e latency and acceptance.")
    p.add_argument("--url", required=True, help="http://HOST:PORT (OpenAI API) or grpc://HOST:PORT")
    p.add_argument("--model", default=None, help="HTTP model id (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="humaneval")
    p.add_argument("--prompt-file", default=None, help="jsonl file of the prompt set")
    p.add_argument("--data-dir", default=None, help="folder holding the prompt sets' standard files")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--request-rate", default="inf", help="comma-separated requests/s (inf: all at once)")
    p.add_argument("--max-concurrency", default="64", help="comma-separated in-flight caps")
    p.add_argument("--seed", type=int, default=0, help="arrival times")
    p.add_argument("--out", default="results/serve", help="folder for serve_bench.json and serve_bench.png")
    p.set_defaults(func=run)
