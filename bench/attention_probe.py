"""Tree attention's split and row-tile defaults (``MIN_CHUNK``, ``block_rows``) against the old ones (256 keys per
slice at least, 32/64-row tiles), graphed: (1) the kernel alone at the trained pair's attention shape (4 heads x 64,
fp32) and a GQA shape in bf16 (32 query / 8 KV heads x 128), 1-16 nodes, a few hundred to a few thousand keys,
each variant checked against ``tree_attention_ref`` on NaN-poisoned output first; (2) the pair's plain decode
step and chain:4 engine step under each setting (greedy engine output checked against plain greedy first).
Each entry is the best of interleaved rounds. GPU only.
Usage (repo root, after bench/gpu_start.sh): python3 bench/attention_probe.py OUT.txt [ROUNDS]"""

import sys

import torch

from stree.bench.common import cancel_all, demo_pair, plain_greedy, tee
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels import tree_attention_triton as ta
from stree.kernels.compare import rel_err
from stree.kernels.cuda_graph import graphed_us, mean_replay_ms
from stree.kernels.tree_attention import tree_attention_ref
from stree.protocols.token_tree import ancestor_mask
from stree.verifier.decode.engine import Engine, Request

say = tee(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_grad_enabled(False)
dev = torch.device("cuda")
OLD, NEW = (256, 0), (ta.MIN_CHUNK, ta.SMALL_ROWS)  # (MIN_CHUNK, SMALL_ROWS); 0 rows: never the 16-row tile
# name -> (MIN_CHUNK, row tile); None: the tile for many rows (32 in fp32, 64 in bf16)
VARIANTS = {"old (256, 32/64 rows)": (256, None), "256, 16 rows": (256, 16), "128, 16 rows": (128, 16),
            "64, 32/64 rows": (64, None), "new (64, 16 rows)": (64, 16), "32, 16 rows": (32, 16)}


def setting(min_chunk: int, small_rows: int) -> None:
    ta.MIN_CHUNK, ta.SMALL_ROWS = min_chunk, small_rows


def kernel_us(hq, hkv, d, dtype, batch, nodes, used, cache=1104) -> dict:
    gen = torch.Generator(device=dev).manual_seed(nodes * 1000 + used)
    parents = torch.tensor([-1] + list(range(nodes - 1)), device=dev)  # a chain: what the pair's engine verifies
    anc = ancestor_mask(parents.expand(batch, -1).contiguous())
    sets = 4
    ks = [torch.randn(batch, cache, hkv, d, device=dev, generator=gen).to(dtype) for _ in range(sets)]
    vs = [torch.randn(batch, cache, hkv, d, device=dev, generator=gen).to(dtype) for _ in range(sets)]
    q = torch.randn(batch, nodes, hq, d, device=dev, generator=gen).to(dtype)
    seqlen = torch.full((batch,), used - nodes, device=dev)
    ref = tree_attention_ref(q.double(), ks[0].double(), vs[0].double(), seqlen, anc)
    out = {}
    rows = nodes * (hq // hkv)
    for name, (min_chunk, tile) in VARIANTS.items():
        if tile == 16 and rows > 16:
            continue  # the 16-row tile is for few rows only
        kw = dict(min_chunk=min_chunk, block_m=tile or ta.block_rows(10**9, half=dtype != torch.float32))
        got = torch.full_like(q, float("nan"))
        ta.tree_attention_triton(q, ks[0], vs[0], seqlen, anc, out=got, **kw)
        err = rel_err(got.double(), ref)
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"{name}: rel err {err:.2e}"
        out[name] = graphed_us([lambda k=k, vv=vv: ta.tree_attention_triton(q, k, vv, seqlen, anc, **kw)
                                for k, vv in zip(ks, vs)], reps=50)
    return out


target, draft = demo_pair(dev)
gen = torch.Generator().manual_seed(0)
prompts = [[int(t) for t in torch.randint(10, 8000, (200 + 7 * i,), generator=gen)] for i in range(4)]


def engine_us(shape: str, batch: int) -> float:
    """Graphed µs of one engine step of ``shape`` (``none``: plain decoding) with the current setting."""
    drafter = None if shape == "none" else DeviceTreeDrafter(draft)
    engine = Engine(target, drafter, [shape], max_batch=batch, max_seqlen=1024)
    got = engine.run([Request(prompts[0], max_new_tokens=48)])[0].output
    assert got == plain_greedy(target, prompts[0]), f"{shape}: engine output differs from plain greedy"
    for p in prompts[:batch]:
        engine.add(Request(p, max_new_tokens=600))
    for _ in range(40):  # a few hundred keys in the cache
        engine.step()
    graph = next(g for k, g in engine.graphs.items() if k[0] == ("none" if shape == "none" else "tree"))
    us = 1e3 * mean_replay_ms(graph)
    cancel_all(engine)
    return us


CASES = [("pair fp32", 4, 4, 64, torch.float32, b, n, used) for b in (1, 4) for n in (1, 5, 16) for used in (300, 1000)]
CASES += [("GQA bf16", 32, 8, 128, torch.bfloat16, 1, n, used) for n in (1, 5) for used in (300, 1000)]
best: dict = {}
for rnd in range(rounds):
    for case in CASES:
        for name, us in kernel_us(*case[1:]).items():
            best[(case, name)] = min(us, best.get((case, name), us))
    for shape in ("none", "chain:4"):
        for label, (chunk, small) in (("old", OLD), ("new", NEW)):
            setting(chunk, small)
            us = engine_us(shape, 1)
            say(f"round {rnd} pair engine {shape} {label}: {us:.1f} µs")
            best[("engine", shape, label)] = min(us, best.get(("engine", shape, label), us))
    setting(*NEW)

say("\nkernel alone, graphed µs, best of rounds (keys: committed keys + nodes; cache 1104 slots)")
say("| shape | batch | nodes | keys | " + " | ".join(VARIANTS) + " |")
say("|---|---|---|---|" + "---|" * len(VARIANTS))
for case in CASES:
    cells = [f"{best[(case, n)]:.1f}" if (case, n) in best else "–" for n in VARIANTS]
    say(f"| {case[0]} | {case[5]} | {case[6]} | {case[7]} | " + " | ".join(cells) + " |")
say("\npair engine step, graphed µs (batch 1, ~250-300 keys), best of rounds")
for shape in ("none", "chain:4"):
    o, n = best[("engine", shape, "old")], best[("engine", shape, "new")]
    say(f"| {shape} | old {o:.1f} | new {n:.1f} | new/old {n / o:.3f} |")
