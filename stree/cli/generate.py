"""``stree generate``: speculative generation from a checkpoint directory, printing text or JSON."""

from __future__ import annotations

import json

import torch

from stree.kernels import numerics

from stree.cli.timing import noise_warning, noisy, time_interleaved
from stree.protocols.tree_shape import SHAPE_HELP
from stree.protocols.drafter import DraftBudget

from stree.verifier.model.checkpoint import load_draft_model, load_model
from stree.verifier.model.lm import DTYPES, SSM_CACHE_DTYPES
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.verifier.decode.loop import generate
from stree.verifier.model.generation_settings import load_generation_settings
from stree.verifier.model.hub import model_folder_arg
from stree.verifier.model.treeflash import TreeFlashNet



def parse_prompt_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` as a non-empty list of ints (ValueError otherwise)."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


def prompt_ids_from_args(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return parse_prompt_ids(args.prompt_ids)
    if tokenizer is None:
        where = args.tokenizer or args.model_dir
        raise ValueError(f"{where} has no tokenizer.json: pass --prompt-ids instead of --prompt")
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise ValueError("--prompt encodes to no tokens")
    return ids


def compare_with_plain(call, drafter: str, runs: int, max_new_tokens: int, temperature: float):
    """``--compare-plain``: time plain decoding and ``drafter`` (``call(name)`` makes a generation), runs
    interleaved. Returns the drafter's result, the record's ``compare_plain`` entry and the lines to print."""
    timed = time_interleaved({"plain": call("none"), drafter: call(drafter)}, runs, max_new_tokens)
    result, plain, spec = timed[drafter].result, timed["plain"], timed[drafter]
    loud = noisy(timed)
    compare = {"runs": runs, "plain_tokens_per_s": plain.median, "tokens_per_s": spec.median,
               "speedup": spec.median / plain.median, "equals_plain": result.token_ids == plain.result.token_ids,
               "too_noisy_to_compare": bool(loud)}
    same = "yes" if compare["equals_plain"] else "no"
    if temperature > 0:
        same += " (sampled: speculation keeps the output's distribution, not the draws)"
    lines = [f"[compare] plain {plain.median:.1f} tok/s, {drafter} {spec.median:.1f} tok/s (medians of {runs} "
             f"runs): {compare['speedup']:.2f}x plain; output equals plain decoding: {same}"]
    if loud:
        lines.append(f"[compare] {noise_warning(loud, timed)}")
    return result, compare, lines


def run(args) -> int:
    if args.numerics:
        numerics.use(args.numerics)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    model = load_model(args.model_dir, device=device, dtype=dtype)
    draft = load_draft_model(args.draft_model, device=device, dtype=dtype) if args.draft_model else None
    for m in (model, draft):
        if hasattr(m, "set_mamba_ssm_cache_dtype"):
            m.set_mamba_ssm_cache_dtype(args.mamba_ssm_cache_dtype)
    settings = load_generation_settings(args.model_dir, args.tokenizer)
    tokenizer = settings.tokenizer
    prompt = prompt_ids_from_args(args, tokenizer)
    drafter = args.drafter or ("none" if draft is None else "treeflash" if isinstance(draft, TreeFlashNet)
                               else "static-tree")
    budget = DraftBudget(
        max_nodes=args.max_nodes or DEFAULT_BUDGET.max_nodes,
        max_depth=args.max_depth or DEFAULT_BUDGET.max_depth,
        max_width=args.max_width or DEFAULT_BUDGET.max_width,
    )

    def caller(seed):
        def call(name):
            return lambda n: generate(
                model, prompt, drafter=name, draft_model=draft, max_new_tokens=n,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed, budget=budget,
                stop_token_ids=() if args.ignore_eos else settings.eos_token_ids, tokenizer=tokenizer,
                cuda_graphs=False if args.eager else None, tree=args.tree, tree_widths=args.tree_widths,
                datastore=args.datastore, lookup_tree=args.lookup_tree,
            )
        return call

    for i in range(args.num_samples):
        call = caller(None if args.seed is None else args.seed + i)
        compare, lines = None, []
        if args.compare_plain:
            result, compare, lines = compare_with_plain(call, drafter, args.compare_runs, args.max_new_tokens,
                                                        args.temperature)
        else:
            result = call(drafter)(args.max_new_tokens)
        if args.json:
            record = {"sample": i, "drafter": drafter, "prompt_ids": prompt, "token_ids": result.token_ids,
                      "text": result.text, "stats": result.stats}
            print(json.dumps(record if compare is None else {**record, "compare_plain": compare}))
        else:
            print(result.text if result.text is not None else " ".join(map(str, result.token_ids)))
            s = result.stats
            print(f"[{drafter}] {s['new_tokens']} tokens in {s['steps']} steps, "
                  f"mean accepted length {s['mean_accepted_length']:.2f}, {s['tokens_per_s']:.1f} tok/s")
            for line in lines:
                print(line)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate with speculative tree decoding",
                       description=f"Tree specs (--tree): {SHAPE_HELP}")
    p.add_argument("model_dir", metavar="MODEL_DIR", type=model_folder_arg,
                   help="checkpoint folder or Hugging Face Hub id (ORG/NAME)")
    p.add_argument("--draft-model", metavar="DIR", type=model_folder_arg,
                   help="draft model checkpoint (folder or Hub id) for model drafters, or a TreeFlash checkpoint "
                        "(drafter treeflash)")
    p.add_argument("--drafter", metavar="NAME",
                   help="none | chain | static-tree | mamba | ngram | retrieval | fusion:A+B | treeflash | "
                        "treeflash-marginal | a plugin name (default: static-tree with --draft-model, treeflash "
                        "with a TreeFlash checkpoint, else none)")
    p.add_argument("--tree", metavar="SPEC", help=f"tree shape for model drafters: {SHAPE_HELP}")
    p.add_argument("--tree-widths", metavar="W1,W2,..", help="static tree width per depth, e.g. 3,2,2,1")
    p.add_argument("--lookup-tree", metavar="SPEC",
                   help="tree shape for the ngram and retrieval drafters, drafted on the device: auto (default: plain "
                        "decoding, lookup chains and tries by goodput), chain:K or trie:DxW")
    p.add_argument("--datastore", metavar="DS", help="retrieval datastore directory")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", metavar="TEXT")
    g.add_argument("--prompt-ids", metavar="1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-nodes", type=int, default=None, help="draft budget: nodes per tree")
    p.add_argument("--max-depth", type=int, default=None, help="draft budget: tree depth")
    p.add_argument("--max-width", type=int, default=None, help="draft budget: children per node")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end tokens")
    p.add_argument("--tokenizer", metavar="DIR", default=None, type=model_folder_arg,
                   help="folder with tokenizer.json / tokenizer_config.json (default: MODEL_DIR)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--numerics", choices=["exact", "fast"], default=None,
                   help="exact: speculative output equals plain decoding bit for bit in every dtype; fast: per-shape "
                        "timed kernels whose rounding follows the tree (default: $STREE_NUMERICS, else exact)")
    p.add_argument("--mamba-ssm-cache-dtype", choices=SSM_CACHE_DTYPES, default="float32",
                   help="SSM state dtype (auto: the model's); float32 is exact, a half state halves its traffic")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (they are on by default on CUDA)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also time plain decoding (runs interleaved, medians) and print the speedup and whether the "
                        "output equals plain decoding's")
    p.add_argument("--compare-runs", type=int, default=3, help="with --compare-plain: timed runs per method")
    p.add_argument("--json", action="store_true", help="one JSON object per sample")
    p.set_defaults(func=run)
