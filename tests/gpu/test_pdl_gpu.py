"""Programmatic dependent launch on the GPU: with ``STREE_PDL`` on, graphed decode steps, tree passes and commits
give the same bits as with it off (pure and hybrid, fp32 and bf16), and the graphed engine still equals plain
greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels import pdl
from stree.kernels.cuda_graph import capture_graph
from stree.protocols.token_tree import TokenTree, TreeBatch
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def pdl_setting():
    yield pdl.use
    pdl.use(None)


def _random_tree(n, gen):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree.from_parents(torch.randint(0, 1000, (n,), generator=gen).tolist(), parents)


def _graphed_run(model, setting):
    """Graphed decode logits over 4 steps, then a graphed tree pass + commit, all under PDL ``setting``."""
    pdl.use(setting)
    gen = torch.Generator().manual_seed(7)
    state = model.new_state(2, 256)
    model.prefill(torch.randint(0, 1000, (2, 40), generator=gen).cuda(), state)
    tok = torch.randint(0, 1000, (2,), generator=gen).cuda()
    graph, logits = capture_graph(lambda: model.step(tok, state))
    steps = []
    for _ in range(4):
        graph.replay()
        steps.append(logits.clone())
    trees = [_random_tree(13, gen), _random_tree(9, gen)]
    batch = TreeBatch.from_trees(trees, pad_to=13).to("cuda")
    paths = [t.path(t.num_nodes - 1)[:3] for t in trees]  # root to the last node, at most 3 nodes
    plen = torch.tensor([len(p) for p in paths], device="cuda")
    path = torch.tensor([p + [0] * (3 - len(p)) for p in paths], device="cuda")
    anc = batch.ancestor_mask().to("cuda")  # made on the host: outside the capture

    def verify():
        out, acts = model.tree_forward(batch, state, anc)
        model.commit(state, acts, path, plen)
        return out

    graph2, tree_logits = capture_graph(verify)  # the warm-up commits once for real; one replay commits again
    graph2.replay()
    torch.cuda.synchronize()
    tensors = [t for layer in state.layers for t in vars(layer).values() if torch.is_tensor(t)]
    return torch.stack(steps), tree_logits.clone(), tensors + [state.seqlen]


def _pdl_on_takes_the_off_choices():
    """The timed per-shape kernel choices (cuBLAS or Triton, fused or not) are made per PDL setting; give the
    PDL-on runs the choices the PDL-off runs made, so that both run the same kernels."""
    from stree.kernels import linear, norm_linear

    for cache in (linear._CHOICE, norm_linear._FUSED):
        for key, value in list(cache.items()):
            if key[-1] == "off":
                cache[key[:-1] + ("on",)] = value


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdl_graphed_steps_equal_pdl_off_bit_for_bit(gpu_models, arch, dtype, pdl_setting):
    """Same kernels with and without PDL: the same bits (a missing wait would read a previous kernel's
    half-written output and show up here)."""
    if not pdl.available(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 or later")
    model = load_model(gpu_models[arch], device="cuda", dtype=dtype)
    off = _graphed_run(model, "off")
    _pdl_on_takes_the_off_choices()
    on = _graphed_run(model, "on")
    for name, a, b in (("decode", off[0], on[0]), ("tree", off[1], on[1])):
        assert torch.equal(a, b), f"{name} logits differ by up to {(a - b).abs().max().item():.3g}"
    assert len(off[2]) == len(on[2]) and all(torch.equal(a, b) for a, b in zip(off[2], on[2]))


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_graphed_engine_with_pdl_equals_plain_greedy_without(gpu_models, arch, pdl_setting):
    target = load_model(gpu_models[arch], device="cuda", dtype=torch.float32)
    draft = load_model(gpu_models["draft"], device="cuda", dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (int(k),), generator=gen).tolist() for k in (5, 31, 17)]
    pdl.use("off")
    plain = [stree.generate(target, p, max_new_tokens=32, cuda_graphs=False).token_ids for p in prompts]
    pdl.use("on")
    for shape in ("chain:4", "beam:4x3"):
        engine = Engine(target, DeviceTreeDrafter(draft), [shape], max_batch=3, max_seqlen=128)
        reqs = engine.run([Request(p, max_new_tokens=32) for p in prompts])
        assert [r.output for r in reqs] == plain, (arch, shape)
        assert engine.graphs and not engine.graphs.failed
