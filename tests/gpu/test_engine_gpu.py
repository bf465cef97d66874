"""GPU-only engine checks: the one-graph step equals the eager step, and batched greedy equals plain greedy (fp32)."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.kernels import backend
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def models(gpu_models):
    dirs = gpu_models
    out = {}
    for name, path in dirs.items():
        model = load_model(path, device="cuda", dtype=torch.float32)
        with torch.no_grad():  # peaked distributions: fewer near-ties, a sharper test
            model.backbone.norm_f.weight.mul_(8.0)
        out[name] = model
    return out


def _prompts(n, gen):
    return [torch.randint(0, 1000, (int(k),), generator=gen).tolist() for k in torch.randint(1, 60, (n,), generator=gen)]


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphed_engine_equals_plain_greedy_fp32(models, arch, batch):
    backend.use("triton")
    try:
        target, draft = models[arch], models["draft"]
        gen = torch.Generator().manual_seed(batch)
        prompts = _prompts(batch + 2, gen)
        plain = [stree.generate(target, p, max_new_tokens=40, cuda_graphs=False).token_ids for p in prompts]
        for shape in ("chain:4", "static:3,2,1", "beam:4x3"):
            engine = Engine(target, DeviceTreeDrafter(draft), [shape], max_batch=batch, max_seqlen=128)
            reqs = engine.run([Request(p, max_new_tokens=40) for p in prompts])
            assert [r.output for r in reqs] == plain, (arch, shape, batch)
            assert engine.graphs and not engine.graphs_failed
    finally:
        backend.use(None)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_one_graph_step_equals_eager_step(models, arch):
    target, draft = models[arch], models["draft"]
    prompts = _prompts(4, torch.Generator().manual_seed(5))
    runs = {}
    for graphs in (False, True):
        engine = Engine(target, DeviceTreeDrafter(draft), ["none", "chain:3", "beam:3x2"], max_batch=4,
                        max_seqlen=128, cuda_graphs=graphs, goodput=True)
        reqs = engine.run([Request(p, max_new_tokens=32) for p in prompts])
        runs[graphs] = [r.output for r in reqs]
    assert runs[True] == runs[False]


def test_sampled_engine_runs_graphed_and_is_seeded(models):
    target, draft = models["hybrid"], models["draft"]
    prompts = _prompts(6, torch.Generator().manual_seed(9))
    a = stree.generate(target, prompts, drafter="static-tree", draft_model=draft, tree_widths="3,2",
                       temperature=1.0, top_k=50, seed=123, max_new_tokens=24)
    b = stree.generate(target, prompts, drafter="static-tree", draft_model=draft, tree_widths="3,2",
                       temperature=1.0, top_k=50, seed=123, max_new_tokens=24)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 24 for x in a)


def test_graphed_top_k_one_after_unfiltered_sampled_graphs_is_greedy(models):
    """A sampled step graph captured without top-k/top-p sorts must not serve a row with top_k=1 (greedy)."""
    target, draft = models["hybrid"], models["draft"]
    prompt = _prompts(1, torch.Generator().manual_seed(4))[0]
    stree.generate(target, prompt, drafter="static-tree", draft_model=draft, tree_widths="3,2", temperature=1.0,
                   seed=5, max_new_tokens=16)
    got = stree.generate(target, prompt, drafter="static-tree", draft_model=draft, tree_widths="3,2",
                         temperature=1.0, top_k=1, seed=5, max_new_tokens=16).token_ids
    want = stree.generate(target, prompt, drafter=None, max_new_tokens=16, cuda_graphs=False).token_ids
    assert got == want
