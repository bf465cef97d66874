"""Where the engine's 4x3 beam draft of the Mamba2-130M shape (random bf16 weights, fp32 SSM state) spends its
time: each part graphed alone (decode steps of 1 and 3 rows in place, the 3-row step from parent rows into the
other scratch state that the draft runs, the acts-only tree pass over the 13-node layout, one depth's top-M glue),
then the GPU kernel time of whole eager drafts by kernel (torch profiler); beside them mamba_ssm's graphed decode
step of the same shape at batch 1 and 3, measured in the same run (the anchor the draft's four steps compare
with). GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/beam_draft_parts.py OUT.txt"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from stree.bench.common import tee
from stree.bench.kernels import LAYER_SHAPES, mamba_ssm_decode_ms
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter, _beam_log_q
from stree.kernels.cuda_graph import graphed_us
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape
from stree.verifier.model.checkpoint import random_init_
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM

say = tee(sys.argv[1])
torch.set_grad_enabled(False)
dev = torch.device("cuda")
cfg = ModelConfig(d_model=768, n_layer=24, vocab_size=50280, ssm_cfg={"layer": "Mamba2"})
torch.manual_seed(0)
model = random_init_(StreeLM(cfg), 0).to(device=dev, dtype=torch.bfloat16).eval()
prompt = torch.randint(0, 50280, (256,), device=dev)
drafter = DeviceTreeDrafter(model, beam_steps=True)
drafter.new_slots(1, 512)
drafter.prefill_slot(0, prompt)
shape, greedy = TreeShape.parse("beam:4x3"), RowSampling.greedy(1, dev)
roots = prompt[-1:].clone()
draft = drafter.draft(shape, roots, greedy, False)
(scratch, other), _, offsets = drafter.beam_scratch[3]
seq0, sseq0 = drafter.state.seqlen.clone(), scratch.seqlen.clone()
feed3 = draft.tokens[0, 1:4].clone()


def step(rows):
    st = drafter.state if rows == 1 else scratch
    s0 = seq0 if rows == 1 else sseq0

    def run():
        model.step(roots if rows == 1 else feed3, st)
        st.seqlen.copy_(s0)
    return run


src = torch.tensor([[2, 0, 1]], device=dev)
parent_rows = (offsets + src).reshape(-1)


def step_from_parents():
    model.step(feed3, other, source=scratch, source_rows=parent_rows)


logits = torch.randn(1, 3, 50280, device=dev, dtype=torch.bfloat16)
scores = torch.zeros(1, 3, device=dev)


def glue():
    logq = _beam_log_q(logits, greedy, False)
    top = torch.topk((scores[:, :, None] + logq).reshape(1, -1), 3, dim=-1)
    s = torch.div(top.indices, 50280, rounding_mode="floor")
    draft.tokens[:, 4:7] = top.indices - s * 50280
    draft.parents[:, 4:7] = 1 + s


parts = {
    "decode step, 1 row": step(1),
    "decode step, 3 rows (in place)": step(3),
    "decode step, 3 rows from parent rows (out of place, as the draft runs)": step_from_parents,
    "acts-only tree pass, 13 nodes": lambda: (drafter._finish(draft.tokens, draft.parents), drafter.acts),
    "one depth's top-M glue": glue,
    "whole draft (4 steps + acts pass)": lambda: (drafter.draft(shape, roots, greedy, False), drafter.acts),
}
say("| part (130M shape, bf16 weights, fp32 state, batch 1) | graphed µs |")
say("|---|---|")
for name, fn in parts.items():
    say(f"| {name} | {graphed_us([fn], reps=30):.1f} |")
for rows in (1, 3):  # mamba_ssm keeps a bf16 state here; ours is fp32
    anchor = mamba_ssm_decode_ms(LAYER_SHAPES["130m"], torch.bfloat16, 50280, 256, rows)
    say(f"| mamba_ssm decode step, {rows} row(s) (causal-conv1d, bf16 state) | "
        f"{1000 * anchor if anchor else float('nan'):.1f} |")

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        drafter.draft(shape, roots, greedy, False)
        _ = drafter.acts  # the commit's acts pass, part of what the draft costs
    torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_time_total > 0]
events.sort(key=lambda e: -e.device_time_total)
total = sum(e.device_time_total for e in events)
say(f"\neager draft x5: {total / 5:.1f} µs GPU kernel time per draft, {sum(e.count for e in events) / 5:.0f} kernels")
say("| kernel | µs per draft | calls per draft |")
say("|---|---|---|")
for e in events[:18]:
    say(f"| {e.key[:90]} | {e.device_time_total / 5:.1f} | {e.count / 5:.0f} |")
