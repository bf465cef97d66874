"""Programmatic dependent launch (``STREE_PDL``) off against on, whole model, CUDA-graphed: the decode step, the
16- and 32-node tree forward + commit, and (130M) the engine's 4x3 beam draft, at the trained pair's target (fp32)
and the 130M and 2.7B shapes (bf16, random weights). Each model's graphed decode logits with PDL on are first
checked bit for bit against PDL off over several steps. GPU only (Hopper).
Usage (repo root, after bench/gpu_start.sh): python3 bench/pdl_probe.py OUT.txt [SHAPES...]"""

import sys

import torch

from stree.bench.common import tee
from stree.bench.kernels import LAYER_SHAPES, complete_binary_parents, engine_beam_draft_ms, root_to_leaf_paths
from stree.kernels import pdl
from stree.kernels.cuda_graph import capture_graph, graphed_us
from stree.protocols.token_tree import TokenTree, TreeBatch
from stree.verifier.model.checkpoint import load_model, random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM

say = tee(sys.argv[1])
shapes = sys.argv[2:] or ["pair", "130m", "2.7b"]
torch.set_grad_enabled(False)
dev = torch.device("cuda")
say(f"triton {__import__('triton').__version__}, PDL available: {pdl.available(dev)}")


def build(name):
    if name == "pair":
        return load_model("checkpoints/demo-target", device=dev, dtype=torch.float32).eval()
    s = LAYER_SHAPES[name]
    cfg = ModelConfig(d_model=s["d_model"], n_layer=s["n_layer"], vocab_size=50280, ssm_cfg={"layer": "Mamba2"})
    torch.manual_seed(0)
    return random_init_(StreeLM(cfg), 0).to(device=dev, dtype=torch.bfloat16).eval()


def decode_logits(model, base, tok, steps=4):
    st = base.clone()
    graph, out = capture_graph(lambda: model.step(tok, st))
    seen = []
    for _ in range(steps):
        graph.replay()
        seen.append(out.clone())
    torch.cuda.synchronize()
    return torch.stack(seen)


def timings(model, base, tok, name):
    st = base.clone()
    s0 = st.seqlen.clone()

    def decode():
        model.step(tok, st)
        st.seqlen.copy_(s0)

    out = {"decode": graphed_us([decode], reps=30)}
    for n in (16, 32):
        par = complete_binary_parents(n)
        tree = TokenTree.from_parents(torch.randint(0, model.vocab_size, (n,)).tolist(), par)
        trees = TreeBatch.from_trees([tree]).to(dev)
        anc = TreeBatch.from_trees([tree]).ancestor_mask().to(dev)
        path_nodes = root_to_leaf_paths(par)[0]
        path = torch.tensor([path_nodes], device=dev)
        plen = torch.tensor([len(path_nodes)], device=dev)

        def verify(trees=trees, anc=anc, path=path, plen=plen):
            _, acts = model.tree_forward(trees, st, anc)
            model.commit(st, acts, path, plen)
            st.seqlen.copy_(s0)

        out[f"verify{n}"] = graphed_us([verify], reps=30)
    if name == "130m":
        out["beam4x3"] = 1000 * engine_beam_draft_ms(model, torch.randint(0, model.vocab_size, (1, 128), device=dev))
    return out


table = []
for name in shapes:
    model = build(name)
    prompt = torch.randint(0, model.vocab_size, (1, 128), device=dev)
    base = model.new_state(1, 1024)
    model.prefill(prompt, base)
    tok = prompt[0, -1:].clone()
    got = {}
    for setting in ("off", "on", "off", "on"):  # twice each, interleaved: run-to-run drift shows
        pdl.use(setting)
        logits = decode_logits(model, base, tok)
        if setting not in got:
            got[setting] = logits
        elif not torch.equal(got[setting], logits):
            say(f"{name}: PDL {setting} is not deterministic run to run")
        t = timings(model, base, tok, name)
        table.append((name, setting, t))
        say(f"{name} PDL {setting}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items()))
    same = torch.equal(got["off"], got["on"])
    say(f"{name}: decode logits with PDL on equal PDL off bit for bit: {same}"
        + ("" if same else f" (max abs diff {(got['off'] - got['on']).abs().max().item():.3g})"))
    del model, base
    torch.cuda.empty_cache()
pdl.use(None)

say("\nshape  part        off us   on us   on/off (each the better of two runs)")
for name in shapes:
    rows = [t for n, s, t in table if n == name]
    offs = [t for (n, s, t) in table if n == name and s == "off"]
    ons = [t for (n, s, t) in table if n == name and s == "on"]
    for part in rows[0]:
        a, b = min(o[part] for o in offs), min(o[part] for o in ons)
        say(f"{name:<6} {part:<10}{a:>9.1f}{b:>8.1f}{b / a:>9.3f}")
