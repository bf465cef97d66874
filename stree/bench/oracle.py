"""``stree bench oracle``: the whole system's speed at a given mean accepted length, at full model size.

A target of Mamba2-2.7B's shape (random weights) decodes greedily once; the ``oracle`` drafter then
knows that continuation and is right for exactly k = tau - 1 levels per step, with random wrong
siblings filling a tree of the given size. Speculative decoding runs the real loop (draft, graphed
tree forward, verification, graphed commit) and is held against mamba_ssm's CUDA-graphed one-token
decode and our plain decoding, both measured in the same run. Greedy output must equal plain greedy.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.drafter_service.drafters.oracle import OracleDrafter
from stree.bench.common import add_device_args, device_and_dtype, record_meta, save_record
from stree.bench.kernels import LAYER_SHAPES, mamba_ssm_decode_ms

from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.verifier.decode.loop import generate
from stree.verifier.model.lm import StreeLM

SHAPES = {  # the kernel benchmark's Mamba2 shapes with mamba_ssm's vocabulary; "tiny" runs on a CPU
    **{name: {k: s[k] for k in ("d_model", "n_layer", "d_state", "headdim")} | {"vocab_size": 50280}
       for name, s in LAYER_SHAPES.items()},
    "tiny": dict(d_model=64, n_layer=2, d_state=16, headdim=16, vocab_size=512),
}
TAUS = (2, 3, 4, 6)


def make_target(shape: str, device, dtype) -> StreeLM:
    """Random weights, built on ``device``: mamba_ssm's init with its residual rescaling, an untied LM head, and
    planted successors (``plant_successors_``) so that bf16 rounding cannot change a greedy choice.

    A step's cost does not depend on the weights' values. Without the plant, a random model's top two logits are
    ~0.1 standard deviations apart, and a tree pass rounds differently from a one-token step (their bf16 logits
    differ by ~2 %): outputs that mix the two (``--tree auto``) leave any registered continuation within a few
    tokens, and the oracle is wrong from there on.
    """
    s = SHAPES[shape]
    cfg = ModelConfig(d_model=s["d_model"], n_layer=s["n_layer"], vocab_size=s["vocab_size"], tie_embeddings=False,
                      ssm_cfg={"layer": "Mamba2", "d_state": s["d_state"], "headdim": s["headdim"]})
    with torch.device(device):
        model = StreeLM(cfg)
    random_init_(model, 0, rescale_residual=True)
    return plant_successors_(model, 0).to(dtype=dtype).eval()


@torch.no_grad()
def plant_successors_(model: StreeLM, seed: int) -> StreeLM:
    """Give each token a successor the random model prefers by a wide margin (a random permutation of the vocabulary).

    Embeddings are drawn N(0, 1) (PyTorch's default, against mamba_ssm's 0.02), so the current token's embedding
    dominates the residual stream through every layer; the LM head row of its successor gets that embedding's
    direction added at the rows' mean norm. The greedy choice then leads the runner-up by many standard deviations
    of the logits (measured on the CPU at d_model 1024 x 64 layers: ~15 against 0.1 without it) while the
    continuation stays 128 distinct tokens, and fp32 and bf16 greedy decoding agree.
    """
    emb, head = model.backbone.embedding.weight, model.lm_head.weight
    g = torch.Generator(device=emb.device).manual_seed(seed + 1)
    emb.normal_(0.0, 1.0, generator=g)
    successor = torch.randperm(emb.shape[0], generator=g, device=emb.device)
    head[successor] += emb / emb.norm(dim=1, keepdim=True) * head.norm(dim=1).mean()
    return model


def greedy_refresher(model: StreeLM, length: int, max_seqlen: int):
    """``context -> the next `length` greedy tokens``, by one-token steps on a state of its own."""
    runner = model
    if model.device.type == "cuda":
        from stree.verifier.model.graphed import GraphedLM

        runner = GraphedLM(model, 1, max_seqlen)

    def refresh(context: list) -> list:
        state = runner.new_state(1, max_seqlen)
        if len(context) > 1:
            runner.prefill(torch.tensor([context[:-1]], device=model.device), state)
        tok, out = context[-1], []
        for _ in range(length):
            tok = int(runner.step(torch.tensor([tok], device=model.device), state)[0].float().argmax())
            out.append(tok)
        return out

    return refresh


def timed_generate(model, prompt, drafter, new_tokens: int, repeats: int) -> dict:
    """Best of ``repeats`` runs after one warm-up (graph captures, compilation); decode time only.

    The oracle's continuation refreshes (target passes of their own) are taken out of the decode time.
    """
    generate(model, prompt, drafter=drafter, max_new_tokens=new_tokens)
    best = None
    for _ in range(repeats):
        if drafter is not None:
            drafter.refresh_s, drafter.refreshes = 0.0, 0
        res = generate(model, prompt, drafter=drafter, max_new_tokens=new_tokens)
        st = dict(res.stats)
        st["refreshes"] = drafter.refreshes if drafter is not None else 0
        refresh_s = drafter.refresh_s if drafter is not None else 0.0
        st["decode_s"] = st["elapsed_s"] - st["prefill_s"] - refresh_s
        st["decode_tokens_per_s"] = st["new_tokens"] / st["decode_s"]
        if best is None or st["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
            best = {"token_ids": res.token_ids, **st}
    return best


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    model = make_target(args.shape, device, dtype)
    print(f"target {args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params "
          f"({time.perf_counter() - t0:.0f}s to build)", file=sys.stderr, flush=True)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, shape["vocab_size"], (args.prompt_len,), generator=g).tolist()
    n = args.new_tokens
    max_k = max(args.taus) - 1
    plain = timed_generate(model, prompt, None, n + max_k + 1, args.repeats)
    continuation = plain.pop("token_ids")
    plain_tps = plain["decode_tokens_per_s"]
    ref_ms = None
    if device.type == "cuda" and not args.no_mamba_ssm:
        ref_ms = mamba_ssm_decode_ms(dict(d_model=shape["d_model"], n_layer=shape["n_layer"]), dtype,
                                     shape["vocab_size"], args.prompt_len)
    ref_tps = 1e3 / ref_ms if ref_ms else None
    rows = [dict(method="mamba_ssm_graphed_decode", tau=1.0, nodes=1, decode_tokens_per_s=ref_tps,
                 ms_per_token=ref_ms, note="one CUDA-graphed MambaLMHeadModel step per token; no sampling "
                 "or host work counted" if ref_ms else "mamba_ssm not importable: not measured"),
            dict(method="plain", tau=1.0, nodes=1, decode_tokens_per_s=plain_tps, ms_per_token=1e3 / plain_tps,
                 host_us_p50=plain.get("host_us_p50"))]
    refresh = greedy_refresher(model, 64, args.prompt_len + 2 * n + 64)
    cases = [(tau, size) for tau in args.taus for size in ["chain", *args.tree_sizes]]
    for tau, size in tqdm(cases, desc="oracle", file=sys.stderr):
        k = tau - 1
        nodes = k + 2 if size == "chain" else int(size)
        if nodes < k + 2 or nodes > DEFAULT_BUDGET.max_nodes:
            continue
        drafter = OracleDrafter(prompt, continuation, shape["vocab_size"], k, nodes, seed=args.seed, refresh=refresh)
        res = timed_generate(model, prompt, drafter, n, args.repeats)
        out = res.pop("token_ids")
        tps = res["decode_tokens_per_s"]
        rows.append(dict(method="oracle-chain" if size == "chain" else f"oracle-tree{nodes}", target_tau=tau,
                         tau=round(res["mean_accepted_length"], 3), nodes=nodes, decode_tokens_per_s=tps,
                         ms_per_token=1e3 / tps, ms_per_step=1e3 * res["decode_s"] / res["steps"],
                         continuation_refreshes=res["refreshes"],
                         speedup_vs_plain=tps / plain_tps, speedup_vs_mamba_ssm=tps / ref_tps if ref_tps else None,
                         host_us_p50=res.get("host_us_p50"),
                         steps=res["steps"], output_equals_plain_greedy=out == continuation[:n]))
    record = {**record_meta("oracle", device), "shape": args.shape, **shape, "dtype": args.dtype,
              "prompt_len": args.prompt_len, "new_tokens": n, "repeats": args.repeats,
              "torch": torch.__version__, "rows": rows}
    print_table(record)
    if args.out:
        save_record(args.out, record)
        plot(record, Path(args.out).with_suffix(".png"))
    return 0


def plot(record: dict, path: Path) -> None:
    """Tokens/s against measured τ, one line per tree size, with mamba_ssm's decode and our plain decoding."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method in dict.fromkeys(r["method"] for r in rows if r["method"].startswith("oracle")):
        pts = sorted((r["tau"], r["decode_tokens_per_s"]) for r in rows if r["method"] == method)
        ax.plot(*zip(*pts), "o-", label=method.replace("oracle-", "oracle "))
    for r, style in ((r, s) for r in rows for m, s in (("plain", ":"), ("mamba_ssm_graphed_decode", "--"))
                     if r["method"] == m and r.get("decode_tokens_per_s")):
        ax.axhline(r["decode_tokens_per_s"], ls=style, color="gray", label=r["method"])
    ax.set_xlabel("measured mean accepted length τ")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{record['shape']} shape, {record['dtype']}, {record['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(record: dict) -> None:
    print(f"oracle drafter, {record['shape']} shape, {record['device']}, {record['new_tokens']} new tokens")
    print(f"{'method':<26}{'tau':>6}{'nodes':>6}{'tok/s':>9}{'ms/tok':>8}{'x plain':>8}{'x mamba_ssm':>12}"
          f"{'== greedy':>10}")
    for r in record["rows"]:
        tps = r.get("decode_tokens_per_s")
        fmt = lambda v, f: (f"{v:{f}}" if v is not None else "-")  # noqa: E731
        print(f"{r['method']:<26}{r['tau']:>6.2f}{r['nodes']:>6}{fmt(tps, '9.1f'):>9}"
              f"{fmt(r.get('ms_per_token'), '8.3f'):>8}{fmt(r.get('speedup_vs_plain'), '8.2f'):>8}"
              f"{fmt(r.get('speedup_vs_mamba_ssm'), '12.2f'):>12}{str(r.get('output_equals_plain_greedy', '')):>10}")


def add_parser(sub) -> None:
    p = sub.add_parser("oracle", help="speed at a given accepted length (oracle drafter), full-size target")
    p.add_argument("--shape", choices=sorted(SHAPES), default="2.7b")
    p.add_argument("--taus", type=lambda s: [int(x) for x in s.split(",")], default=list(TAUS),
                   help="mean accepted lengths to measure (k = tau - 1 right levels)")
    p.add_argument("--tree-sizes", type=lambda s: [x for x in s.split(",") if x], default=["16", "32"],
                   help="tree sizes (nodes) besides the bare chain")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    add_device_args(p, "bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mamba-ssm", action="store_true", help="skip the mamba_ssm baseline")
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.set_defaults(func=run)
