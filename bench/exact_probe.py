"""Where a hybrid target's tree pass first stops equalling its decode steps, layer by layer (GPU diagnosis).

Builds a random hybrid target of the scale pair's shape (d_model 1024, attention at two layers; ``--layers``
Mamba2+attention blocks), prefills prompts of several lengths (across the exact attention's ``KEY_SPLIT`` and the
engine's 512-token prefill chunk) and compares, bit for bit, every block's output:

- ``chain``: a 5-node chain tree pass against five decode steps along it;
- ``binary``: a 15-node binary tree pass against decode steps along its first root-to-leaf path;
- ``commit``: decode steps after committing 3 chain nodes against the steps that produced them;
- ``prefill``: one prefill of the prompt's last 5 tokens against five decode steps;
- ``engine``: ``stree.generate`` plain greedy against chain:4 speculation with a random drafter (first differing
  token).

Prints one line per (dtype, prompt length, check): ``ok`` or the first block (index and kind) and node that
differ. Usage: ``python bench/exact_probe.py [--layers 8] [--lengths 40,600,1100] [--dtypes float32,bfloat16]``.
"""

from __future__ import annotations

import argparse

import torch

import stree
from stree.protocols.token_tree import TokenTree, TreeBatch
from stree.training.model_shape import Shape, make_model
from stree.verifier.model.lm import Block

VOCAB = 8192


class Recorder:
    """Every ``Block.run`` output while active, in call order (one list per pass)."""

    def __init__(self):
        self.outs: list = []
        self._orig = Block.run

    def __enter__(self):
        rec, orig = self, self._orig

        def run(block, *a, **k):
            out = orig(block, *a, **k)
            rec.outs.append(out[0].detach().float().clone())
            return out

        Block.run = run
        return self

    def __exit__(self, *exc):
        Block.run = self._orig


def kinds(model) -> list:
    return ["attn" if b.is_attention else b.kind for b in model.backbone.layers]


def steps_outputs(model, state, tokens: list) -> list:
    """Per decode step, the blocks' outputs ``[n_layer][d]`` and the logits."""
    out = []
    for t in tokens:
        with Recorder() as rec:
            logits = model.step(torch.tensor([t], device=model.device), state)
        out.append(([o.reshape(-1) for o in rec.outs], logits[0]))
    return out


def first_diff(model, want: list, got_layers: list, got_logits, nodes: list) -> str:
    """Compare node ``nodes[i]`` of a pass (``got_layers[l]`` ``[.., N, d]``) with decode step i."""
    names = kinds(model)
    for i, node in enumerate(nodes):
        layers, logits = want[i]
        for li, ref in enumerate(layers):
            row = got_layers[li].reshape(-1, got_layers[li].shape[-1])[node]
            if not torch.equal(row, ref):
                err = (row - ref).abs().max().item()
                return f"step {i} (node {node}): block {li} ({names[li]}) differs first, max |diff| {err:.3g}"
        if not torch.equal(got_logits.reshape(-1, got_logits.shape[-1])[node], logits):
            return f"step {i} (node {node}): logits differ after equal blocks"
    return "ok"


def tree_batch(tokens: list, parents: list, device):
    tree = TokenTree.from_parents(tokens, parents)
    batch = TreeBatch.from_trees([tree])
    return batch.to(device), batch.ancestor_mask().to(device)


def probe(model, prompt: torch.Tensor, gen: torch.Generator) -> dict:
    device = model.device
    base = model.new_state(1, prompt.shape[1] + 64)
    model.prefill(prompt[:, :-1], base)
    last = int(prompt[0, -1])
    toks = [last] + torch.randint(0, VOCAB, (14,), generator=gen).tolist()
    res = {}
    chain = list(range(-1, 4))
    want = steps_outputs(model, base.clone(), toks[:5])
    batch, anc = tree_batch(toks[:5], chain, device)
    with Recorder() as rec:
        logits, acts = model.tree_forward(batch, base.clone(), anc)
    res["chain"] = first_diff(model, want, rec.outs, logits, list(range(5)))
    binary = [-1] + [(i - 1) // 2 for i in range(1, 15)]
    path = [0, 1, 3, 7]
    want_b = steps_outputs(model, base.clone(), [toks[n] for n in path])
    batch, anc = tree_batch(toks[:15], binary, device)
    with Recorder() as rec:
        logits, _ = model.tree_forward(batch, base.clone(), anc)
    res["binary"] = first_diff(model, want_b, rec.outs, logits, path)
    state = base.clone()
    batch, anc = tree_batch(toks[:5], chain, device)
    _, acts = model.tree_forward(batch, state, anc)
    model.commit(state, acts, torch.tensor([[0, 1, 2, 3, 4]], device=device), torch.tensor([3], device=device))
    res["commit"] = commit_check(model, base, state, toks)
    pre = base.clone()
    with Recorder() as rec:
        logits = model.prefill(torch.tensor([toks[:5]], device=device), pre)
    res["prefill"] = first_diff(model, want, rec.outs, logits, list(range(5)))
    return res


def commit_check(model, base, committed, toks) -> str:
    """Steps after a 3-node commit against steps after three decode steps."""
    seq = base.clone()
    steps_outputs(model, seq, toks[:3])
    want = steps_outputs(model, seq, toks[3:6])
    got = steps_outputs(model, committed, toks[3:6])
    names = kinds(model)
    for i, ((wl, wlog), (gl, glog)) in enumerate(zip(want, got)):
        for li, (w, g) in enumerate(zip(wl, gl)):
            if not torch.equal(w, g):
                return f"step {i} after commit: block {li} ({names[li]}) differs first"
        if not torch.equal(wlog, glog):
            return f"step {i} after commit: logits differ"
    return "ok"


def loop_greedy(model, prompt: list, n: int) -> tuple[list, list]:
    """Plain greedy by the model's own prefill and decode steps (no engine): tokens and each step's top-2 margin."""
    state = model.new_state(1, len(prompt) + n + 8)
    model.prefill(torch.tensor([prompt[:-1]], device=model.device), state)
    tok, out, margins = prompt[-1], [], []
    for _ in range(n):
        logits = model.step(torch.tensor([tok], device=model.device), state)[0]
        top = logits.topk(2).values
        tok = int(logits.argmax())
        out.append(tok)
        margins.append(float(top[0] - top[1]))
    return out, margins


def engine_check(target, draft, prompt: list, n: int = 48) -> str:
    """The engine's plain and speculative greedy runs (graphed and eager) against ``loop_greedy``: the first
    differing token of each and the reference's top-2 logit margin there."""
    want, margins = loop_greedy(target, prompt, n)
    runs = {"plain": {}, "chain:4": dict(drafter="mamba", draft_model=draft, tree="chain:4"),
            "beam:4x3": dict(drafter="mamba", draft_model=draft, tree="beam:4x3")}
    verdicts = []
    for name, opts in runs.items():
        for graphs in (True, False):
            got = stree.generate(target, [prompt], max_new_tokens=n, cuda_graphs=graphs, **opts)[0].token_ids
            bad = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
            if bad is not None:
                verdicts.append(f"{name}{'' if graphs else ' eager'} token {bad} (margin {margins[bad]:.3g})")
    return "ok" if not verdicts else "; ".join(verdicts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--lengths", default="40,600,1100")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    attn = (args.layers // 3, 2 * args.layers // 3)
    torch.set_grad_enabled(False)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        target = make_model(Shape(args.d_model, args.layers, attn), VOCAB, 0, device).to(dtype).eval()
        draft = make_model(Shape(256, 2), VOCAB, 1, device).to(dtype).eval()
        gen = torch.Generator().manual_seed(0)
        for length in map(int, args.lengths.split(",")):
            prompt = torch.randint(0, VOCAB, (1, length), generator=gen)
            res = probe(target, prompt.to(device), gen)
            res["engine"] = engine_check(target, draft, prompt[0].tolist())
            for check, verdict in res.items():
                print(f"[exact-probe] {name} len {length} {check}: {verdict}", flush=True)
        del target, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
