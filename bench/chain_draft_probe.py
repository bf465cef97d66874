"""Where a chain:4 step of the trained pair (fp32) spends its time, under two switches: the chain draft by
one-token steps against a tree pass per depth (``DeviceTreeDrafter(chain_steps=)``), and the gated norm +
``out_proj`` fusion as timed per op against forced on at every row count (``norm_linear.use_fused``). Graphed
microseconds of the draft alone, the target's 5-node tree pass, and a whole engine step; each entry is the best
of interleaved rounds. Greedy engine output is checked against plain greedy first. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/chain_draft_probe.py OUT.txt [ROUNDS]"""

import sys

import torch

from stree.bench.common import cancel_all, demo_pair, plain_greedy, tee
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels import norm_linear
from stree.kernels.cuda_graph import graphed_us, mean_replay_ms
from stree.protocols.token_tree import TreeBatch
from stree.verifier.decode.engine import Engine, Request

say = tee(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
torch.set_grad_enabled(False)
dev = torch.device("cuda")
target, draft = demo_pair(dev)
prompt = [int(t) for t in torch.randint(10, 8000, (40,), generator=torch.Generator().manual_seed(0))]
real_use_fused = norm_linear.use_fused


def forcing(force: bool):
    """``use_fused`` as timed (False) or always fused where the fused kernel fits (True)."""
    def use_fused(kind, x, weight, fused, unfused):
        chosen = real_use_fused(kind, x, weight, fused, unfused)
        if not force or kind != "gated_rmsnorm":
            return chosen
        from stree.kernels.linear_rows_triton import fits
        return fits(x.numel() // x.shape[-1], weight)
    norm_linear.use_fused = use_fused


def engine_for(steps: bool):
    drafter = DeviceTreeDrafter(draft, chain_steps=steps)
    engine = Engine(target, drafter, ["chain:4"], max_batch=1, max_seqlen=512)
    return engine, drafter


def measure(steps: bool, force: bool) -> dict:
    forcing(force)
    engine, drafter = engine_for(steps)
    want = plain_greedy(target, prompt)
    got = engine.run([Request(prompt, max_new_tokens=48)])[0].output
    assert got == want, f"chain steps={steps} fused={force}: engine output differs from plain greedy"
    engine.add(Request(prompt, max_new_tokens=400))
    for _ in range(8):
        engine.step()
    graph = next(g for k, g in engine.graphs.items() if k[0] == "tree")
    shape = engine.shapes[0]
    out = {"step": 1e3 * mean_replay_ms(graph),
           "draft": graphed_us([lambda: drafter.draft(shape, engine.roots, engine.sampling, False)], reps=50)}
    state = target.new_state(1, 512)
    nodes = torch.arange(5, device=dev)
    trees = TreeBatch(torch.zeros(1, 5, dtype=torch.long, device=dev), (nodes - 1)[None].contiguous(),
                      nodes[None].contiguous(), torch.full((1,), 5, device=dev), True)
    ids = torch.zeros(1, dtype=torch.long, device=dev)
    s0 = state.seqlen.clone()

    def decode():
        target.step(ids, state)
        state.seqlen.copy_(s0)
    out["tree5"] = graphed_us([lambda: target.tree_forward(trees, state)], reps=50)
    out["decode"] = graphed_us([decode], reps=50)
    cancel_all(engine)
    return out


cases = [(s, f) for s in (False, True) for f in (False, True)]
best: dict = {}
for rnd in range(rounds):
    for case in cases:
        got = measure(*case)
        say(f"round {rnd} chain_steps={case[0]} gated_fused={case[1]}: "
            + " ".join(f"{k}={v:.1f}" for k, v in got.items()))
        best[case] = {k: min(v, best.get(case, {}).get(k, v)) for k, v in got.items()}
say("\nbest of rounds, graphed us (trained pair, fp32, batch 1, chain:4)")
say("| chain draft | gated norm + out_proj | engine step | draft | target tree pass 5 | target decode |")
say("|---|---|---|---|---|---|")
for (steps, force), v in best.items():
    say(f"| {'steps' if steps else 'tree passes'} | {'forced fused' if force else 'timed'} | {v['step']:.1f} | "
        f"{v['draft']:.1f} | {v['tree5']:.1f} | {v['decode']:.1f} |")
