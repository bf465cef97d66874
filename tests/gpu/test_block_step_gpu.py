"""The one-launch persistent Mamba2 block step on the GPU: equals its reference (fp32 and bf16) at the pair's, the
130M and the 2.7B shapes, launch after launch and inside a CUDA graph, without a barrier ever giving up; a model
decoding through it greedily equals the three-op path."""

from __future__ import annotations

import pytest
import torch

from stree.kernels.compare import rel_err
from stree.kernels.mamba_block_step import mamba_block_step_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = {"pair": (256, 8, 64, 64), "130m": (768, 24, 64, 128), "2.7b": (2560, 80, 64, 128)}  # d, H, P, S


def _case(shape, rows, dtype, seed):
    from stree.bench.common import random_block_params

    d, h, hp, s = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = random_block_params(d, h, hp, s, dtype, g)

    def rnd(*size, dt=dtype):
        return torch.randn(*size, device="cuda", generator=g).to(dt)

    c = h * hp + 2 * s
    return rnd(rows, d), rnd(rows, d, dt=torch.float32), p, rnd(rows, c, 3), rnd(rows, h, hp, s, dt=torch.float32)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 4, 13])
def test_persistent_block_step_matches_reference(dtype, tol, shape, rows):
    from stree.kernels.mamba_block_step_triton import barrier_failed, mamba_block_step_triton

    x, r, p, cs, hs = _case(shape, rows, dtype, seed=rows + len(shape))
    cs_ref, hs_ref = cs.clone(), hs.clone()
    for programs_per_sm in (1, 2, 4):  # three launches in a row, each grid cap; the states advance each time
        want, want_r = mamba_block_step_ref(x, r, p, cs_ref, hs_ref)
        got, got_r = mamba_block_step_triton(x, r, p, cs, hs, programs_per_sm=programs_per_sm)
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < tol and rel_err(got_r, want_r) < 1e-6
        assert rel_err(cs, cs_ref) < tol and rel_err(hs, hs_ref) < tol
    assert not barrier_failed(x.device)


def test_persistent_block_step_in_a_cuda_graph_equals_eager_steps():
    """Captured once and replayed: each replay advances the states as one eager reference step does."""
    from stree.kernels.cuda_graph import capture_graph
    from stree.kernels.mamba_block_step_triton import barrier_failed, mamba_block_step_triton

    x, r, p, cs, hs = _case("130m", 2, torch.float32, seed=5)
    cs_ref, hs_ref = cs.clone(), hs.clone()
    mamba_block_step_ref(x, r, p, cs_ref, hs_ref)  # capture_graph's warm-up runs the step once for real
    graph, (out, _) = capture_graph(lambda: mamba_block_step_triton(x, r, p, cs, hs))
    for _ in range(3):
        want, _ = mamba_block_step_ref(x, r, p, cs_ref, hs_ref)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, want) < 1e-4 and rel_err(hs, hs_ref) < 1e-4
    assert not barrier_failed(x.device)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_graphed_decode_through_block_step_equals_split_ops_fp32(gpu_models, arch, monkeypatch):
    """A graphed fp32 greedy generation with every Mamba2 block forced through the one launch equals the one
    with the three ops forced, token for token."""
    import stree
    from stree.kernels import mamba_block_step
    from stree.verifier.model.checkpoint import load_model

    outs = {}
    for forced in ("split", "fused"):
        monkeypatch.setenv("STREE_BLOCK_STEP", forced)
        mamba_block_step._CHOICE.clear()
        model = load_model(gpu_models[arch], device="cuda", dtype=torch.float32)
        outs[forced] = [o.token_ids for o in stree.generate(model, [[1, 2, 3, 4], [5, 6]], max_new_tokens=24)]
    assert outs["fused"] == outs["split"]
    assert all(v != "split" for v in mamba_block_step.block_step_choices().values())
