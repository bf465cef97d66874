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
            assert engine.graphs and not engine.graphs.failed
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


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_graphed_prefill_equals_eager_prefill(models, arch):
    """Admission's prefill as CUDA-graph replays (rows and widths padded to buckets, graphs captured in the
    middle of a run) leaves every row as the eager batched prefill does."""
    from stree.verifier.model.batch_prefill import prefill_contexts
    from stree.verifier.model.graphed_prefill import PrefillRunner

    backend.use("triton")
    try:
        model = models[arch]
        gen = torch.Generator().manual_seed(11)
        contexts = [torch.randint(0, 1000, (int(n),), generator=gen).tolist() for n in (70, 3, 0, 33, 129, 5, 16)]
        runner = PrefillRunner(model, 4, 256, chunk=32)
        got = {}

        def deliver(index, first, hidden):
            rows = runner.scratch.rows(len(index), first).clone()
            for k, j in enumerate(index):
                got[j] = (rows.rows(1, k).clone(), hidden[k].clone())

        assert runner.run(contexts, deliver) and runner.graphs and not runner.failed
        ref = prefill_contexts(model, contexts, chunk=32, room=256 - 129)
        for k, j in enumerate(ref.order):
            state, hidden = got[j]
            n = len(contexts[j])
            assert int(state.seqlen[0]) == n
            torch.testing.assert_close(hidden, ref.hidden[k], atol=1e-4, rtol=1e-4)
            for mine, theirs in zip(state.layers, ref.state.rows(1, k).layers):
                for name, t in vars(theirs).items():
                    m = getattr(mine, name)
                    if name.endswith("_cache"):
                        m, t = m[:, :n], t[:, :n]
                    torch.testing.assert_close(m, t, atol=1e-4, rtol=1e-4, msg=f"{arch} context {j} {name}")
    finally:
        backend.use(None)


def test_warm_up_times_every_step_graph_for_goodput_control(models):
    """With CUDA graphs, warm_up captures every step path and times each graph's replay: goodput control then
    knows every shape's step cost (greedy and sampled) before its first step, runs plain decoding from the start
    (nothing measured fits the exploration budget yet), and output still equals plain greedy."""
    target, draft = models["hybrid"], models["draft"]
    engine = Engine(target, DeviceTreeDrafter(draft), ["none", "chain:3", "beam:3x2"], max_batch=2, max_seqlen=256,
                    goodput=True)
    engine.warm_up()
    for sampled in (False, True):
        rows = [r for r in engine.goodput.table() if r["sampled"] == sampled]
        assert len(rows) == 3 and all(r["known_cost"] and r["cost_ms"] > 0 and r["steps"] == 0 for r in rows)
    assert {key.kind for key in engine.graphs.costs} >= {"plain", "tree"}
    prompts = _prompts(2, torch.Generator().manual_seed(11))
    plain = [stree.generate(target, p, max_new_tokens=24, cuda_graphs=False).token_ids for p in prompts]
    assert str(engine.goodput.choose()) == "none"
    reqs = engine.run([Request(p, max_new_tokens=24) for p in prompts])
    assert [r.output for r in reqs] == plain
