"""Where the Mamba2-2.7B verify step (tree pass + commit, random bf16 weights, fp32 SSM state, batch 1) spends its
time at 8, 16 and 32 nodes, beside the decode step and mamba_ssm's graphed decode in the same run: graphed times of
each part with the fused tree conv+scan kernel and with the two unfused kernels, the commit by SSM tile, the demo
target's tree pass both ways, then the GPU time of eager tree passes by kernel (torch profiler). GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/verify_parts.py OUT.txt [quick]"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from stree.bench.common import demo_pair, tee
from stree.bench.kernels import LAYER_SHAPES, complete_binary_parents, mamba_ssm_decode_ms, root_to_leaf_paths
from stree.kernels import replay_triton as rt
from stree.kernels import tree_conv_scan_triton as tcs
from stree.kernels.cuda_graph import graphed_us
from stree.protocols.token_tree import TokenTree, TreeBatch
from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM

say = tee(sys.argv[1])
torch.set_grad_enabled(False)
dev, vocab, prompt_len = torch.device("cuda"), 50280, 256
shape = LAYER_SHAPES["2.7b"]
anchor = mamba_ssm_decode_ms(shape, torch.bfloat16, vocab, prompt_len, 1)
cfg = ModelConfig(d_model=shape["d_model"], n_layer=shape["n_layer"], vocab_size=vocab, ssm_cfg={"layer": "Mamba2"})
torch.manual_seed(0)
model = random_init_(StreeLM(cfg), 0).to(device=dev, dtype=torch.bfloat16).eval()
prompt = torch.randint(0, vocab, (1, prompt_len), device=dev)
state = model.new_state(1, prompt_len + 64)
model.prefill(prompt, state)
seq0 = state.seqlen.clone()
tok = torch.randint(0, vocab, (1,), device=dev)


def decode():
    model.step(tok, state)
    state.seqlen.copy_(seq0)


def tree_parts(n, lm=None, st=None, s0=None):
    lm, st, s0 = (model, state, seq0) if lm is None else (lm, st, s0)
    par = complete_binary_parents(n)
    tree = TokenTree.from_parents(torch.randint(0, lm.vocab_size, (n,)).tolist(), par)
    trees = TreeBatch.from_trees([tree]).to(dev)
    anc = TreeBatch.from_trees([tree]).ancestor_mask().to(dev)
    nodes = root_to_leaf_paths(par)[0]
    path, plen = torch.tensor([nodes], device=dev), torch.tensor([len(nodes)], device=dev)
    holder = {}

    def fwd():
        holder["acts"] = lm.tree_forward(trees, st, anc)[1]

    def acts_only():
        lm.tree_forward(trees, st, anc, acts_only=True)

    def commit():
        lm.commit(st, holder["acts"], path, plen)
        st.seqlen.copy_(s0)
    return fwd, acts_only, commit


def fused_up_to(nodes) -> None:
    tcs.tree_conv_scan_triton.__kwdefaults__["max_fused_nodes"] = nodes


def label(fused) -> str:
    return "default routing" if fused is None else f"fused up to {fused}"


quick = sys.argv[2:] == ["quick"]  # the default routing and tiles only, rows printed as measured
rows = [("mamba_ssm decode step (causal-conv1d)", anchor * 1000 if anchor else float("nan")),
        ("our decode step", graphed_us([decode], reps=20))]
if quick:
    say(f"| part (Mamba2-2.7B shape, bf16 weights, fp32 state, batch 1, {torch.cuda.get_device_name()}) "
        "| graphed µs |")
    say("|---|---|")
    for name, us in rows:
        say(f"| {name} | {us:.1f} |")
for n in (32, 16) if quick else (8, 16, 32):
    for fused in (None,) if quick else (None, 0, 16):
        fused_up_to(fused)
        fwd, acts_only, commit = tree_parts(n)
        name = f"{n} nodes, {label(fused)}"
        t_fwd = graphed_us([fwd], reps=20)
        fwd()
        t_commit = graphed_us([commit], reps=20)
        rows += [(f"tree pass with LM head, {name}", t_fwd), (f"tree pass without LM head, {name}",
                                                            graphed_us([acts_only], reps=20)),
                 (f"commit, {name}", t_commit), (f"verify step (pass + commit), {name}", t_fwd + t_commit)]
        if quick:
            say(f"| verify step (pass + commit), {name} | {t_fwd + t_commit:.1f} |")
fused_up_to(None)
if quick:
    sys.exit(0)

# the commit's SSM tile (block_p, block_s, warps): each variant's committed state must equal the default's
fwd, _, commit = tree_parts(32)
fwd()
knobs = rt.replay_layers_triton.__kwdefaults__
base_state = state.clone()
commit()
want = [t.clone() for t in (state.layers[0].ssm_state, state.layers[-1].ssm_state)]
for bp, bs, nw in [(None, None, None), (32, 64, 4), (64, 128, 8), (32, 128, 4)]:
    knobs.update(block_p=bp, block_s=bs, num_warps=nw)
    state.copy_from(base_state)
    commit()
    same = all(torch.equal(a, b) for a, b in zip(want, (state.layers[0].ssm_state, state.layers[-1].ssm_state)))
    rows.append((f"commit, 32 nodes, SSM tile {bp or 64} x {bs or 64} x {nw or 4} warps"
                 f"{' (default)' * (bp is None)}{'' if same else ' MISMATCH'}", graphed_us([commit], reps=20)))
knobs.update(block_p=None, block_s=None, num_warps=None)
state.copy_from(base_state)

say(f"| part (Mamba2-2.7B shape, bf16 weights, fp32 state, batch 1, {torch.cuda.get_device_name()}) | graphed µs |")
say("|---|---|")
for name, us in rows:
    say(f"| {name} | {us:.1f} |")

# the demo pair's target (fp32): tree pass with the fused kernel against the two kernels
target, _ = demo_pair(dev)
pair_state = target.new_state(1, 512)
target.prefill(torch.randint(0, target.vocab_size, (1, 300), device=dev), pair_state)
pair_s0 = pair_state.seqlen.clone()
say("\n| demo target (fp32, batch 1), tree pass with LM head | fused up to 16: graphed µs | unfused: graphed µs |")
say("|---|---|---|")
for n in (4, 8, 16):
    times = []
    for fused in (16, 0):
        fused_up_to(fused)
        times.append(graphed_us([tree_parts(n, target, pair_state, pair_s0)[0]], reps=20))
    say(f"| {n} nodes | {times[0]:.1f} | {times[1]:.1f} |")
fused_up_to(None)

for n in (16, 32):
    fwd, _, _ = tree_parts(n)
    fwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    say(f"\neager {n}-node tree pass x3: {total / 3:.1f} µs GPU kernel time per pass, "
        f"{sum(e.count for e in events) / 3:.0f} kernels")
    say("| kernel | µs per pass | calls per pass | µs per call |")
    say("|---|---|---|---|")
    for e in events[:14]:
        say(f"| {e.key[:80]} | {e.device_time_total / 3:.1f} | {e.count / 3:.0f} | "
            f"{e.device_time_total / e.count:.2f} |")
