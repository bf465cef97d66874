"""Beam drafts by M-row decode steps on a scratch state against a tree pass per depth
(``DeviceTreeDrafter(beam_steps=)``), graphed: (1) the trained pair in fp32 at batch 1 and 16 (engine step of
beam:5x3 and beam:4x2 beside chain:4, draft alone; greedy engine output checked against plain greedy first);
(2) the Mamba2-130M shape with random bf16 weights, the 4x3 beam draft (the issues' 1.5 ms / 1 ms goals).
Each entry is the best of interleaved rounds. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/beam_draft_probe.py OUT.txt [ROUNDS]"""

import sys

import torch

from stree.bench.common import cancel_all, demo_pair, plain_greedy, tee
from stree.bench.kernels import engine_beam_draft_ms
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels.cuda_graph import graphed_us, mean_replay_ms
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM

say = tee(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_grad_enabled(False)
dev = torch.device("cuda")
target, draft = demo_pair(dev)
gen = torch.Generator().manual_seed(0)
prompts = [[int(t) for t in torch.randint(10, 8000, (40 + 3 * i,), generator=gen)] for i in range(16)]
SHAPES = ("chain:4", "beam:4x2", "beam:5x3")


def pair_case(shape: str, steps: bool, batch: int) -> dict:
    drafter = DeviceTreeDrafter(draft, beam_steps=steps)
    engine = Engine(target, drafter, [shape], max_batch=batch, max_seqlen=512)
    if batch == 1:
        got = engine.run([Request(prompts[0], max_new_tokens=48)])[0].output
        assert got == plain_greedy(target, prompts[0]), f"{shape} steps={steps}: engine output differs from plain"
    for p in prompts[:batch]:
        engine.add(Request(p, max_new_tokens=400))
    for _ in range(8):
        engine.step()
    graph = next(g for k, g in engine.graphs.items() if k[0] == "tree")
    tree = TreeShape.parse(shape)
    out = {"step": 1e3 * mean_replay_ms(graph),
           "draft": graphed_us([lambda: (drafter.draft(tree, engine.roots, engine.sampling, False), drafter.acts)],
                               reps=50)}
    cancel_all(engine)
    return out


def model_130m(dtype=torch.bfloat16):
    cfg = ModelConfig(d_model=768, n_layer=24, vocab_size=50280, ssm_cfg={"layer": "Mamba2"})
    torch.manual_seed(0)
    return random_init_(StreeLM(cfg), 0).to(device=dev, dtype=dtype).eval()


best: dict = {}


def keep(key, got: dict) -> None:
    best[key] = {k: min(v, best.get(key, {}).get(k, v)) for k, v in got.items()}


m130 = model_130m()
prompt130 = torch.randint(0, 50280, (1, 256), device=dev)
# the two 130M drafts lay out the same tree where bf16 rounding does not reorder a near tie
a, b = DeviceTreeDrafter(m130, beam_steps=True), DeviceTreeDrafter(m130, beam_steps=False)
for d in (a, b):
    d.new_slots(1, 512)
    d.prefill_slot(0, prompt130[0])
from stree.protocols.sampling import RowSampling  # noqa: E402

shape43 = TreeShape.parse("beam:4x3")
same = 0
for r in range(8):
    roots = prompt130[0, r: r + 1].clone()
    ta = a.draft(shape43, roots, RowSampling.greedy(1, dev), False)
    tb = b.draft(shape43, roots, RowSampling.greedy(1, dev), False)
    same += int(torch.equal(ta.tokens, tb.tokens) and torch.equal(ta.parents, tb.parents))
say(f"130M bf16 beam:4x3: steps and tree passes laid out the same tree in {same} of 8 drafts")
a = b = None

for rnd in range(rounds):
    for steps in (True, False):
        ms = engine_beam_draft_ms(m130, prompt130, beam_steps=steps)
        say(f"round {rnd} 130M beam:4x3 steps={steps}: draft+commit {ms:.3f} ms")
        keep(("130m", steps), {"draft_ms": ms})
    for batch in (1, 16):
        for shape in SHAPES:
            for steps in ((True, False) if shape.startswith("beam") else (True,)):
                got = pair_case(shape, steps, batch)
                say(f"round {rnd} pair b{batch} {shape} steps={steps}: "
                    + " ".join(f"{k}={v:.1f}" for k, v in got.items()))
                keep((batch, shape, steps), got)

say("\nbest of rounds, graphed")
say("| case | beam draft | engine step µs | draft µs |")
say("|---|---|---|---|")
for key, v in best.items():
    if key[0] == "130m":
        continue
    batch, shape, steps = key
    say(f"| pair b{batch} {shape} | {'steps' if steps else 'tree passes'} | {v['step']:.1f} | {v['draft']:.1f} |")
for steps in (True, False):
    say(f"| 130M bf16 beam:4x3 draft + commit | {'steps' if steps else 'tree passes'} | – | "
        f"{1e3 * best[('130m', steps)]['draft_ms']:.1f} |")
