"""``stree bench numerics``: what exact numerics cost. The Mamba2-2.7B-shape decode step and verify steps (tree
forward + commit of a complete binary tree) at each batch size, CUDA-graphed, in exact numerics against fast
numerics on the same random weights, and against mamba_ssm's own graphed decode step (with causal-conv1d when it
is installed) in the same run. Before timing, it checks on this model that an exact verify step's logits at every
node of a root-to-leaf path equal decode steps' along it, bit for bit (and says whether fast numerics does).

Record: ``--out FILE`` (e.g. ``results/numerics-h100-<date>.json``), rows ``{what, batch, nodes, exact_ms, fast_ms,
exact_over_fast, mamba_ssm_ms, exact_over_mamba_ssm}``. ``--device cpu`` runs a tiny shape eagerly (a smoke run).
"""

from __future__ import annotations

import sys
import time

import torch

from stree.bench.common import record_meta, save_record
from stree.bench.kernels import LAYER_SHAPES, complete_binary_parents, mamba_ssm_decode_ms, root_to_leaf_paths
from stree.kernels import numerics
from stree.protocols.token_tree import TokenTree, TreeBatch

SHAPES = {**LAYER_SHAPES, "tiny": dict(nheads=4, headdim=16, d_state=16, ngroups=1, d_model=32, n_layer=2, d_conv=4)}
VOCAB = 50280
MODES = ("exact", "fast")


def build_model(shape: dict, n_layer: int, vocab: int, device, dtype):
    """A random Mamba2 LM of ``shape`` (mamba_ssm's initialisation), ``n_layer`` layers."""
    from stree.verifier.model.checkpoint import random_init_
    from stree.verifier.model.config import ModelConfig
    from stree.verifier.model.lm import StreeLM

    cfg = ModelConfig(d_model=shape["d_model"], n_layer=n_layer, vocab_size=vocab,
                      ssm_cfg={"layer": "Mamba2", "d_state": shape["d_state"], "headdim": shape["headdim"],
                               "ngroups": shape["ngroups"], "d_conv": shape["d_conv"]})
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: a 2.7B model is 11 GB in float32
        model = StreeLM(cfg)
    return random_init_(model, 0).to(dtype=dtype).eval()


def time_ms(fn, device, reps: int = 20) -> float:
    """Milliseconds per call of ``fn``: graphed on a GPU (``graphed_us``), eager wall time on the CPU."""
    fn()
    if device.type == "cuda":
        from stree.kernels.cuda_graph import graphed_us

        return graphed_us([fn], reps=reps) / 1000
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1000


def _trees(n: int, batch: int, vocab: int, device):
    par = complete_binary_parents(n)
    trees = [TokenTree.from_parents(torch.randint(0, vocab, (n,)).tolist(), par) for _ in range(batch)]
    host = TreeBatch.from_trees(trees)
    path = root_to_leaf_paths(par)[0]
    return (trees, host.to(device), host.ancestor_mask().to(device), torch.tensor([path] * batch, device=device),
            torch.full((batch,), len(path), device=device))


@torch.no_grad()
def tree_equals_steps(model, base, n: int, vocab: int) -> bool:
    """Whether the verify step's logits at every node of the first root-to-leaf path of an ``n``-node binary tree
    equal decode steps' along that path, bit for bit (batch 1, on copies of ``base``)."""
    trees, batch, anc, path, _ = _trees(n, 1, vocab, base.seqlen.device)
    logits, _ = model.tree_forward(batch, base.clone(), anc)
    state = base.clone()
    same = True
    for node in path[0].tolist():
        step = model.step(batch.tokens[:, node], state)
        same &= torch.equal(step[0], logits[0, node])
    return bool(same)


@torch.no_grad()
def time_mode(model, prompt: torch.Tensor, batch: int, nodes, vocab: int, reps: int) -> dict:
    """``{("decode", 1): ms, ("verify", n): ms, ...}`` at ``batch`` sequences in the current numerics."""
    device = prompt.device
    state = model.new_state(batch, prompt.shape[1] + 64)
    model.prefill(prompt.expand(batch, -1).contiguous(), state)
    seq0 = state.seqlen.clone()
    tok = torch.randint(0, vocab, (batch,), device=device)

    def decode():
        model.step(tok, state)
        state.seqlen.copy_(seq0)

    out = {("decode", 1): time_ms(decode, device, reps)}
    for n in nodes:
        _, trees, anc, path, plen = _trees(n, batch, vocab, device)

        def verify(trees=trees, anc=anc, path=path, plen=plen):
            _, acts = model.tree_forward(trees, state, anc)
            model.commit(state, acts, path, plen)
            state.seqlen.copy_(seq0)

        out[("verify", n)] = time_ms(verify, device, reps)
    del state
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    shape = SHAPES[args.shape]
    n_layer = args.layers or shape["n_layer"]
    model = build_model(shape, n_layer, VOCAB, device, dtype)
    prompt = torch.randint(0, VOCAB, (1, args.prompt_len), device=device)
    base = model.new_state(1, args.prompt_len + 64)
    with torch.no_grad():
        model.prefill(prompt, base)
    checks, times = {}, {}
    try:
        for mode in MODES:
            numerics.use(mode)
            checks[mode] = tree_equals_steps(model, base, max(args.nodes), VOCAB)
            for b in args.batches:
                times[(mode, b)] = time_mode(model, prompt, b, args.nodes, VOCAB, args.reps)
                print(f"[numerics] {mode} batch {b} done", file=sys.stderr, flush=True)
    finally:
        numerics.use(None)
    del model, base
    anchors = {}
    if device.type == "cuda" and not args.no_mamba_ssm:
        for b in args.batches:
            anchors[b] = mamba_ssm_decode_ms(dict(d_model=shape["d_model"], n_layer=n_layer), dtype, VOCAB,
                                             args.prompt_len, b)
    rows = []
    for b in args.batches:
        for key in times[("exact", b)]:
            what, n = key
            exact, fast = times[("exact", b)][key], times[("fast", b)][key]
            ref = anchors.get(b) if what == "decode" else None
            rows.append(dict(what=f"{what}_step", batch=b, nodes=n, exact_ms=round(exact, 4), fast_ms=round(fast, 4),
                             exact_over_fast=round(exact / fast, 4), mamba_ssm_ms=ref and round(ref, 4),
                             exact_over_mamba_ssm=ref and round(exact / ref, 4)))
    record = {**record_meta("numerics", device), "shape": {**shape, "n_layer": n_layer, "name": args.shape},
              "dtype": args.dtype, "prompt_len": args.prompt_len,
              "tree": "complete binary, commit of its first root-to-leaf path",
              "tree_logits_equal_decode_steps": checks, "rows": rows}
    print(f"numerics: {args.shape} shape, {n_layer} layers, {args.dtype}, {record['device']}")
    print(f"{'what':12} {'batch':>5} {'nodes':>5} {'exact ms':>9} {'fast ms':>9} {'exact/fast':>10} "
          f"{'mamba_ssm ms':>12} {'exact/mamba_ssm':>15}")
    for r in rows:
        ref = f"{r['mamba_ssm_ms']:12.3f} {r['exact_over_mamba_ssm']:15.3f}" if r["mamba_ssm_ms"] else \
            f"{'-':>12} {'-':>15}"
        print(f"{r['what']:12} {r['batch']:5d} {r['nodes']:5d} {r['exact_ms']:9.3f} {r['fast_ms']:9.3f} "
              f"{r['exact_over_fast']:10.3f} {ref}")
    for mode, same in checks.items():
        print(f"{mode}: {max(args.nodes)}-node tree logits == decode-step logits along a root-to-leaf path: {same}")
    if args.out:
        save_record(args.out, record)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("numerics", help="exact against fast numerics (and mamba_ssm): decode and verify steps")
    p.add_argument("--shape", choices=list(SHAPES), default="2.7b")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's own, 64 at 2.7b)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--nodes", nargs="+", type=int, default=[16, 32], help="verify-step tree sizes (binary trees)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default=None)
    p.add_argument("--no-mamba-ssm", action="store_true", help="skip the mamba_ssm decode anchor")
    p.add_argument("--out", default=None, help="JSON record (e.g. results/numerics-h100-DATE.json)")
    p.set_defaults(func=run)
