"""``stree bench e2e``: tokens/s of every decoding method on real prompt sets, with the trained demo pair.

For each prompt set x temperature x method, ``N`` prompts each generate ``--max-new-tokens`` tokens.
Per method: decode tokens/s (target and drafter prefills excluded, the same for every method),
speedup over our plain decoding, mean accepted length per step (bonus token included, vLLM's
convention) and where the time went (draft / verify / commit). Greedy runs also check that every
method's output equals plain greedy decoding. mamba_ssm's own ``generate`` runs where it can load
the target. One JSON record per (method, prompt set, temperature) plus a PNG.

Lookup methods draft on the device: ``ngram`` and ``retrieval`` choose plain decoding, lookup chains or tries per
step by goodput (``--lookup-tree auto``); ``ngram-tree`` is the n-gram drafter on the one lookup tree that the fused
methods use (``--fused-lookup-tree``), ``fusion-ngram`` / ``fusion`` fuse it (n-gram / retrieval) with the model's
``--beam-tree``, so fused trees are measured against each part alone (``beam``, ``ngram-tree``); ``fusion-auto``
lets goodput control choose among the model's shapes, the lookup's, their fusions and plain decoding. The prompt
sets whose answers copy their context are ``code_edit`` and ``spec_bench_copy`` (``prompt_sets.py``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from stree.drafter_service.drafters.fusion.device_fusion import FUSED_LOOKUP
from stree.protocols.registry import create_drafter

from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.hub import model_folder_arg
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.verifier.decode.loop import generate, warm_up_engines
from stree.bench.common import (DEMO_DRAFT, DEMO_TARGET, add_device_args, device_and_dtype, record_meta,
                                save_record)
from stree.bench.prompt_sets import PROMPT_SETS, load_prompt_set
from stree.verifier.model.tokenizer import load_tokenizer

METHODS = ("plain", "mamba_ssm", "chain", "static", "beam", "auto", "ngram", "ngram-tree", "retrieval", "fusion",
           "fusion-ngram", "fusion-auto", "treeflash", "treeflash-marginal")
DRAFT_METHODS = ("chain", "static", "beam", "auto", "fusion", "fusion-ngram", "fusion-auto")  # need --draft DIR
TREEFLASH_METHODS = ("treeflash", "treeflash-marginal")  # need --treeflash DIR (stree train drafter --kind treeflash)
DEFAULT_TREEFLASH = "checkpoints/demo-treeflash"
DEFAULT_TARGET, DEFAULT_DRAFT = DEMO_TARGET, DEMO_DRAFT


def make_drafter(method: str, draft, datastore, args):
    """The drafter object for a method name (None for plain decoding)."""
    if method == "plain":
        return None
    if method == "chain":
        return create_drafter("chain", draft_model=draft, num_speculative_tokens=args.chain_length)
    if method == "static":
        return create_drafter("static-tree", draft_model=draft, tree_widths=args.static_widths)
    if method == "beam":
        return create_drafter("mamba", draft_model=draft, tree=args.beam_tree)
    if method == "auto":  # the engine picks plain, chain or tree per step by measured goodput
        return create_drafter("mamba", draft_model=draft, tree="auto")
    if method == "ngram":
        return create_drafter("ngram", lookup_tree=args.lookup_tree)
    if method == "ngram-tree":  # the lookup part of the fused methods, alone
        return create_drafter("ngram", lookup_tree=args.fused_lookup_tree)
    if method == "retrieval":
        return create_drafter("retrieval", datastore=datastore, max_occurrences=args.retrieval_occurrences,
                              lookup_tree=args.lookup_tree)
    if method == "fusion":  # RASD: the draft model's beam tree merged with retrieval's tree on the device
        return create_drafter("fusion:mamba+retrieval", draft_model=draft, tree=args.beam_tree, datastore=datastore,
                              max_occurrences=args.retrieval_occurrences, lookup_tree=args.fused_lookup_tree)
    if method == "fusion-ngram":  # the beam tree merged with the n-gram tree
        return create_drafter("fusion:mamba+ngram", draft_model=draft, tree=args.beam_tree,
                              lookup_tree=args.fused_lookup_tree)
    if method == "fusion-auto":  # per step: model, lookup, fused or plain, by goodput
        return create_drafter("fusion:mamba+ngram", draft_model=draft, tree="auto", lookup_tree=args.lookup_tree)
    if method in TREEFLASH_METHODS:  # one block pass from the target's hidden states; marginal: no conditional head
        return create_drafter(method, treeflash=args.treeflash, tree=args.treeflash_tree, device=args.device)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def build_datastore(tokenizer, vocab_size: int, max_bytes: int):
    """A retrieval datastore over installed packages' sources (the demo pair's training domain)."""
    from stree.drafter_service.drafters.retrieval.datastore import Datastore
    from stree.training.corpus import build_corpus

    corpus = build_corpus(max_bytes=max_bytes, seed=1)
    seqs = [e.ids for e in tokenizer.encode_batch(corpus.train, add_special_tokens=False)]
    return Datastore.build(seqs, vocab_size, meta={"source": "site-packages sources", "bytes": corpus.meta["bytes"]})


def encode_prompts(tokenizer, prompts, max_prompt_tokens: int) -> list[tuple[str, list[int]]]:
    out = []
    for pid, text in prompts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids[-max_prompt_tokens:]
        out.append((pid, ids or [0]))
    return out


def run_method(model, drafter, prompts, temperature: float, args) -> dict:
    """Generate for every prompt; the totals of their stats and the outputs."""
    totals = dict(tokens=0, steps=0, decode_s=0.0, host_us_p50=0.0, fallbacks=0, accepted_per_depth=[])
    outputs = []
    for i, (_, ids) in enumerate(prompts):
        res = generate(model, ids, drafter=drafter, max_new_tokens=args.max_new_tokens, temperature=temperature,
                       seed=args.seed + i)
        s = res.stats
        totals["tokens"] += s["new_tokens"]
        totals["steps"] += s["steps"]
        totals["decode_s"] += s["elapsed_s"] - s["prefill_s"]
        totals["host_us_p50"] = max(totals["host_us_p50"], s.get("host_us_p50", 0.0))
        totals["fallbacks"] += s["drafter_fallbacks"]
        depth = totals["accepted_per_depth"]
        for d, count in enumerate(s["num_accepted_tokens_per_pos"]):
            depth.extend([0] * (d + 1 - len(depth)))
            depth[d] += count
        outputs.append(res.token_ids)
        if "goodput" in s:  # auto: what goodput control believed after the last prompt, shape by shape
            totals["goodput"] = s["goodput"]
    return {**totals, "outputs": outputs}


def mamba_ssm_method(target_dir: str, prompts, temperature: float, args) -> dict:
    """mamba_ssm's ``MambaLMHeadModel.generate`` (CUDA graphs) on the same checkpoint, or why it could not run."""
    from stree.bench.kernels import import_mamba_ssm

    if not torch.cuda.is_available() or import_mamba_ssm()[0] is None:
        return {"error": "mamba_ssm is not importable here (needs CUDA and mamba_ssm's Triton kernels)"}
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        from safetensors.torch import load_file

        cfg = json.loads((Path(target_dir) / "config.json").read_text())
        fields = MambaConfig.__dataclass_fields__
        mcfg = MambaConfig(**{k: v for k, v in cfg.items() if k in fields})
        model = MambaLMHeadModel(mcfg, device="cuda", dtype=torch.bfloat16).eval()
        sd = load_file(str(Path(target_dir) / "model.safetensors"))
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in sd.items()}, strict=False)
        n = args.max_new_tokens
        sample = dict(top_k=1) if temperature == 0 else dict(top_k=0, top_p=0.0, temperature=temperature)
        totals = dict(tokens=0, steps=0, decode_s=0.0)
        outputs = []
        for _, ids in prompts:
            x = torch.tensor([ids], device="cuda")
            times = {}
            for length in (1, n, 1, n):  # warm-up pair (graph capture), then the timed pair
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model.generate(x, max_length=len(ids) + length, cg=True, **sample)
                torch.cuda.synchronize()
                times[length] = time.perf_counter() - t0
            seq = out if isinstance(out, torch.Tensor) else out.sequences
            outputs.append(seq[0, len(ids):].tolist())
            totals["tokens"] += n - 1
            totals["steps"] += n - 1
            totals["decode_s"] += max(1e-9, times[n] - times[1])  # generate(N) - generate(1): decode only
        del model
        torch.cuda.empty_cache()
        return {**totals, "outputs": outputs}
    except Exception as exc:  # noqa: BLE001 - the baseline is optional; record why it is missing
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(args) -> int:
    device, dtype = device_and_dtype(args)
    target = load_model(args.target, device=device, dtype=dtype)
    draft = load_model(args.draft, device=device, dtype=dtype) if args.draft else None
    tokenizer = load_tokenizer(args.target)
    if tokenizer is None:
        raise ValueError(f"{args.target} has no tokenizer.json; the e2e benchmark needs text prompts tokenized")
    if args.methods is None:  # every method; TreeFlash's only where its checkpoint exists
        have_tf = (Path(args.treeflash) / "config.json").is_file()
        args.methods = ",".join(m for m in METHODS if have_tf or m not in TREEFLASH_METHODS)
    args.device = str(device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
        if m in DRAFT_METHODS and draft is None:
            raise ValueError(f"method {m} needs --draft DIR")
        if m in TREEFLASH_METHODS and not (Path(args.treeflash) / "config.json").is_file():
            raise ValueError(f"method {m} needs --treeflash DIR (a TreeFlash checkpoint; none at {args.treeflash})")
    datastore = None
    if {"retrieval", "fusion"} & set(methods):
        t0 = time.perf_counter()
        datastore = build_datastore(tokenizer, target.vocab_size, args.datastore_bytes)
        print(f"datastore: {len(datastore)} tokens ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    sets = [s.strip() for s in args.prompt_sets.split(",") if s.strip()]
    paths = {"mt_bench": args.mt_bench, "gsm8k": args.gsm8k, "spec_bench": args.spec_bench,
             "spec_bench_copy": args.spec_bench, "in_domain": args.corpus_root, "code_edit": args.corpus_root}
    prompt_sets = {s: encode_prompts(tokenizer, load_prompt_set(s, args.num_prompts, paths.get(s), args.data_dir),
                                     args.max_prompt_tokens) for s in sets}
    drafters = {m: make_drafter(m, draft, datastore, args) for m in methods if m != "mamba_ssm"}
    # graph captures and kernel compilation happen here, not in the timings; the longest prompt sizes each
    # method's engine for every prompt to come (a larger one later would be rebuilt and recaptured mid-run)
    warm = max((ids for s in sets for _, ids in prompt_sets[s]), key=len)
    for m, d in drafters.items():
        generate(target, warm, drafter=d, max_new_tokens=args.max_new_tokens, temperature=args.temperatures[0], seed=0)
    warm_up_engines(target)  # auto: every step path captured now (one generate call takes only some of them)
    for m, d in drafters.items():
        for t in args.temperatures:
            generate(target, warm, drafter=d, max_new_tokens=args.max_new_tokens, temperature=t, seed=0)
    rows = []
    cases = [(s, t, m) for s in sets for t in args.temperatures for m in methods]
    plain_out: dict = {}
    meta = {**record_meta("e2e", device), "target": args.target, "draft": args.draft,
            "target_params": sum(p.numel() for p in target.parameters()), "target_layers": target.config.n_layer,
            "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts,
            "chain_length": args.chain_length, "static_widths": args.static_widths, "beam_tree": args.beam_tree,
            "lookup_tree": args.lookup_tree, "fused_lookup_tree": args.fused_lookup_tree,
            "budget": vars(DEFAULT_BUDGET), "torch": torch.__version__}
    for s, t, m in tqdm(cases, desc="e2e", file=sys.stderr):
        if args.out:  # partial records survive an interrupted run
            save_record(args.out, {**meta, "complete": False, "rows": rows})
        if m == "mamba_ssm":
            res = mamba_ssm_method(args.target, prompt_sets[s], t, args)
        else:
            res = run_method(target, drafters[m], prompt_sets[s], t, args)
        row = dict(method=m, prompt_set=s, temperature=t, prompts=len(prompt_sets[s]))
        if "error" in res:
            rows.append({**row, "error": res["error"]})
            continue
        outs = res.pop("outputs")
        if m == "plain":
            plain_out[(s, t)] = outs
        tps = res["tokens"] / res["decode_s"]
        row.update(tokens=res["tokens"], steps=res["steps"], decode_tokens_per_s=tps,
                   mean_accepted_length=res["tokens"] / res["steps"] if res["steps"] else None,
                   host_us_per_step_p50=res.get("host_us_p50"),
                   decode_s=res["decode_s"], drafter_fallbacks=res.get("fallbacks"))
        if "accepted_per_depth" in res:  # steps whose draft was accepted to depth d + 1: acceptance by depth
            row["accepted_per_depth"] = res["accepted_per_depth"]
        if "goodput" in res:
            row["goodput"] = res["goodput"]
        if t == 0 and (s, t) in plain_out and m != "mamba_ssm":
            row["output_equals_plain_greedy"] = outs == plain_out[(s, t)]
        rows.append(row)
    for r in rows:  # speedups over plain decoding and over chain speculation, same set and temperature
        base = {m: x for x in rows if x["prompt_set"] == r["prompt_set"] and x["temperature"] == r["temperature"]
                for m in [x["method"]] if "decode_tokens_per_s" in x}
        if "decode_tokens_per_s" in r:
            for ref in ("plain", "chain"):
                if ref in base:
                    r[f"speedup_vs_{ref}"] = r["decode_tokens_per_s"] / base[ref]["decode_tokens_per_s"]
    print_table(rows)
    if args.out:
        save_record(args.out, {**meta, "complete": True, "rows": rows})
        plot(rows, Path(args.out).with_suffix(".png"))
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'set':<16}{'T':>4} {'method':<13}{'tok/s':>9}{'x plain':>8}{'x chain':>8}{'tau':>6}"
          f"{'host us':>8}{'==greedy':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['prompt_set']:<16}{r['temperature']:>4} {r['method']:<13} not run: {r['error'][:90]}")
            continue
        host = r.get("host_us_per_step_p50")
        tau = f"{r['mean_accepted_length']:6.2f}" if r.get("mean_accepted_length") else f"{'-':>6}"
        print(f"{r['prompt_set']:<16}{r['temperature']:>4} {r['method']:<13}{r['decode_tokens_per_s']:>9.0f}"
              f"{r.get('speedup_vs_plain', float('nan')):>8.2f}{r.get('speedup_vs_chain', float('nan')):>8.2f}"
              f"{tau}{(f'{host:8.0f}' if host else f'{chr(45):>8}')}{str(r.get('output_equals_plain_greedy', '')):>9}")


def plot(rows: list[dict], path: Path) -> None:
    """Per temperature: speedup over plain decoding (top) and mean accepted length τ (bottom), per method and set."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    temps = sorted({r["temperature"] for r in rows})
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)
               if any(x["method"] == m and "speedup_vs_plain" in x for x in rows)]
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 7), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for col, t in enumerate(temps):
        for row, (key, label) in enumerate((("speedup_vs_plain", "decode speedup over plain decoding"),
                                            ("mean_accepted_length", "mean accepted length τ (bonus included)"))):
            ax = axes[row][col]
            for j, m in enumerate(methods):
                vals = [next((r.get(key) or 0 for r in rows if r["method"] == m and r["prompt_set"] == s
                              and r["temperature"] == t), 0) for s in sets]
                ax.bar([i + j * width for i in range(len(sets))], vals, width, label=m)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(sets))])
            ax.set_xticklabels(sets)
            ax.set_title(f"temperature {t}: {label}", fontsize=9)
    axes[0][0].set_ylabel("x plain decoding (tokens/s)")
    axes[1][0].set_ylabel("tokens per target pass")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("e2e", help="tokens/s of every decoding method on HumanEval, MT-Bench, GSM8K, Spec-Bench")
    p.add_argument("--target", default=DEFAULT_TARGET, type=model_folder_arg,
                   help="target checkpoint folder or Hub id (default: the trained demo target)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, type=model_folder_arg,
                   help="draft model checkpoint folder or Hub id")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join(METHODS)} (default: all; TreeFlash's if --treeflash exists)")
    p.add_argument("--treeflash", default=DEFAULT_TREEFLASH,
                   help="TreeFlash checkpoint dir (stree train drafter --kind treeflash)")
    p.add_argument("--treeflash-tree", default="static:3,2,1,1", help="TreeFlash tree layout (chain:K or static:W1,..)")
    p.add_argument("--prompt-sets", default=",".join(PROMPT_SETS), help=f"comma-separated, from {', '.join(PROMPT_SETS)}")
    p.add_argument("--mt-bench", default=None, help="MT-Bench question.jsonl")
    p.add_argument("--gsm8k", default=None, help="GSM8K test.jsonl")
    p.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl (spec_bench and spec_bench_copy)")
    p.add_argument("--corpus-root", default=None,
                   help="a site-packages-like folder for in_domain and code_edit (default: this interpreter's)")
    p.add_argument("--data-dir", default=None, help="folder with mt_bench/, gsm8k/, spec_bench/ (e.g. ../shared/data)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per set, spread over the set (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts keep their last tokens")
    p.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    p.add_argument("--chain-length", type=int, default=4)
    p.add_argument("--static-widths", type=lambda s: [int(x) for x in s.split(",")], default=[3, 1, 1, 1])
    p.add_argument("--beam-tree", default="beam:5x4", help="beam tree spec for beam and fusion (beam:DEPTHxBEAMS)")
    p.add_argument("--lookup-tree", default="auto",
                   help="ngram, retrieval and fusion-auto lookup trees: auto (goodput), chain:K or trie:DxW")
    p.add_argument("--fused-lookup-tree", default=str(FUSED_LOOKUP),
                   help="the lookup tree of ngram-tree, fusion and fusion-ngram (chain:K or trie:DxW)")
    p.add_argument("--datastore-bytes", type=int, default=4_000_000, help="retrieval datastore text size")
    p.add_argument("--retrieval-occurrences", type=int, default=64,
                   help="corpus occurrences of the matched suffix the retrieval drafter counts")
    add_device_args(p, "bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON record here (and the plot beside it as .png)")
    p.set_defaults(func=run)
