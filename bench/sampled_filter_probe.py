"""Sampled verification of top-k / top-p rows on the GPU: the torch walk (the reference, which was the only path for
filtered rows) against ``ops.sampled_verify`` (filtered logits, then the one-launch kernel), graphed us per call,
for a chain of 5 nodes and a 13-node tree at batch 1 and 8, over the demo pair's and a 50k vocabulary. Each call
is first checked against the reference (the share of rows drawing the same tokens). GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/sampled_filter_probe.py OUT.txt"""

import sys

import torch

from stree.bench.common import tee
from stree.kernels import ops
from stree.kernels.cuda_graph import graphed_us
from stree.kernels.sampled_verify import sampled_verify_ref
from stree.protocols.token_tree import DraftMode

say = tee(sys.argv[1])


say(f"{'vocab':>6}{'batch':>6}{'nodes':>6}{'walk us':>10}{'kernel us':>11}{'speed-up':>10}  same rows")
g = torch.Generator(device="cuda").manual_seed(0)
for vocab in (8192, 50280):
    for b in (1, 8):
        for n, parents in ((5, [-1, 0, 1, 2, 3]), (13, [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7])):
            par = torch.tensor(parents, device="cuda").expand(b, n).contiguous()
            logits = torch.randn(b, n, vocab, device="cuda", generator=g) * 3
            tokens = logits.argmax(-1).gather(1, par.clamp_min(0))
            args = (tokens, par, torch.ones(b, n, dtype=torch.bool, device="cuda"), logits,
                    torch.ones(b, device="cuda"), torch.full((b,), 50, device="cuda"),
                    torch.full((b,), 0.9, device="cuda"), DraftMode.DETERMINISTIC, None,
                    torch.rand(b, n, device="cuda", generator=g), torch.rand(b, n, device="cuda", generator=g), 4, 3)
            want, got = sampled_verify_ref(*args), ops.sampled_verify(*args)
            same = float((got[3] == want[3]).all(1).float().mean())
            t_ref = graphed_us([lambda: sampled_verify_ref(*args)], reps=20)
            t_ops = graphed_us([lambda: ops.sampled_verify(*args)], reps=20)
            say(f"{vocab:>6}{b:>6}{n:>6}{t_ref:>10.1f}{t_ops:>11.1f}{t_ref / t_ops:>9.2f}x  {same:.2f}")
