"""GPU-only lookup checks: device n-gram and retrieval drafts on CUDA equal the host drafters' trees, and graphed
engines drafting lookup, retrieval and fused trees (fixed shapes and goodput control) emit plain greedy output (fp32)
with every step graph captured."""

from __future__ import annotations

import random

import pytest
import torch

import stree
from stree.drafter_service.drafters.lookup.device_tree import compact
from stree.drafter_service.drafters.ngram import NgramDrafter
from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.drafter_service.drafters.retrieval.drafter import RetrievalDrafter
from stree.protocols import DraftBudget, SamplingParams
from stree.protocols.drafter import DEFAULT_BUDGET
from stree.protocols.registry import create_drafter
from stree.protocols.sampling import RowSampling
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.decode.loop import device_offer

from lookup_helpers import looping_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 64


@pytest.mark.parametrize("kind", ["ngram", "retrieval"])
def test_cuda_lookup_drafts_equal_host_trees(kind):
    rng = random.Random(3)
    store = Datastore.build([[rng.randint(0, 5) for _ in range(rng.randint(1, 300))] for _ in range(40)], VOCAB)
    for spec in ("lookup:chain:6", "lookup:trie:5x3", "lookup:trie:8x4"):
        shape = TreeShape.parse(spec)
        drafter = (NgramDrafter(lookup_tree=shape) if kind == "ngram"
                   else RetrievalDrafter(store, max_occurrences=32, lookup_tree=shape))
        contexts = [[rng.randint(0, 5) for _ in range(rng.randint(1, 200))] for _ in range(16)]
        dev = drafter.device_drafter().drafter
        dev.new_slots(len(contexts), 512, torch.device("cuda"))
        dev.prefill_slots(list(range(len(contexts))), [c[:-1] for c in contexts])
        roots = torch.tensor([c[-1] for c in contexts], device="cuda")
        d = dev.draft(shape, roots, RowSampling.greedy(len(contexts), "cuda"), False)
        budget = DraftBudget(max_nodes=shape.num_nodes, max_depth=shape.max_depth, max_width=shape.max_width)
        for context, got in zip(contexts, compact(d.tokens.cpu(), d.parents.cpu(), d.valid.cpu())):
            tree = drafter.open(context, SamplingParams()).draft(budget)
            assert got == (tree.tokens.tolist(), tree.parents.tolist()), (kind, spec)


@pytest.fixture(scope="module")
def targets():
    return {arch: looping_target(arch == "hybrid", 0, vocab=VOCAB, device="cuda") for arch in ("mamba2", "hybrid")}


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    from stree.verifier.model.checkpoint import init_model, load_model

    path = init_model(tmp_path_factory.mktemp("lookup") / "draft", arch="mamba2", seed=4, d_model=32, n_layer=1,
                      d_state=8, headdim=8, vocab_size=VOCAB)
    return load_model(path, device="cuda")


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB, (int(k),), generator=gen).tolist() for k in torch.randint(1, 40, (n,), generator=gen)]


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphed_lookup_engines_equal_plain_greedy_fp32(targets, draft, arch, batch):
    target = targets[arch]
    prompts = _prompts(batch + 2)
    plain = [stree.generate(target, p, max_new_tokens=48, cuda_graphs=False).token_ids for p in prompts]
    others = _prompts(16)
    store = Datastore.build([o + r.token_ids for o, r in zip(others, stree.generate(target, others,
                                                                                    max_new_tokens=64))], VOCAB)
    cases = [("ngram", {"lookup_tree": "chain:6"}), ("ngram", {"lookup_tree": "trie:5x3"}), ("ngram", {}),
             ("retrieval", {"datastore": store, "lookup_tree": "trie:4x2"}),
             ("fusion:mamba+ngram", {"tree": "beam:3x2", "draft_model": draft}),
             ("fusion:mamba+ngram", {"tree": "auto", "draft_model": draft})]
    for name, options in cases:
        offer = device_offer(create_drafter(name, **options), DEFAULT_BUDGET)
        engine = Engine(target, offer.drafter, offer.shapes, max_batch=batch, max_seqlen=256,
                        goodput=len(offer.shapes) > 1)
        reqs = engine.run([Request(p, max_new_tokens=48) for p in prompts])
        assert [r.output for r in reqs] == plain, (arch, name, options, batch)
        assert engine.graphs.graphs and not engine.graphs.failed, (name, options)
        if len(offer.shapes) == 1:  # one fixed tree: its drafts must be accepted (the target loops)
            tau = sum(len(r.output) for r in reqs) / sum(r.stats["steps"] for r in reqs)
            assert tau > 1.3, (name, options, tau)


def test_one_graph_lookup_step_equals_eager_step(targets, draft):
    prompts = _prompts(4)
    runs = {}
    for graphs in (False, True):
        offer = device_offer(create_drafter("fusion:mamba+ngram", tree="auto", draft_model=draft), DEFAULT_BUDGET)
        engine = Engine(targets["hybrid"], offer.drafter, offer.shapes, max_batch=4, max_seqlen=256,
                        cuda_graphs=graphs, goodput=True)
        reqs = engine.run([Request(p, max_new_tokens=40) for p in prompts])
        runs[graphs] = [r.output for r in reqs]
    assert runs[True] == runs[False]


def test_history_append_kernel_on_cuda_equals_the_cpu_reference():
    """The one-launch history append on CUDA leaves the CPU reference's buffer and lengths (roots and paths, full
    slots included)."""
    from stree.kernels.history_append import history_append_ref
    from stree.kernels.history_append_triton import history_append_triton

    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 50, (16, 3 + 40), generator=g)
    buf[:, :3] = -1
    length = torch.randint(0, 41, (16,), generator=g)
    gpu_buf, gpu_len = buf.cuda(), length.cuda()
    for step in range(50):
        width = 1 if step % 2 else 9
        new = torch.randint(0, 50, (16, width), generator=g)
        count = None if width == 1 else torch.randint(0, 10, (16,), generator=g)
        history_append_ref(buf, length, new, count, 3)
        history_append_triton(gpu_buf, gpu_len, new.cuda(), None if count is None else count.cuda(), 3)
        assert torch.equal(gpu_buf.cpu(), buf) and torch.equal(gpu_len.cpu(), length)
