"""The one-launch Mamba2 block decode step vs its PyTorch reference (CPU interpreter, fp32, phase by phase)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import on_each_backend, rel_err  # noqa: E402
from stree.kernels.mamba_block_step import MambaBlockParams, mamba_block_step_ref  # noqa: E402
from stree.kernels.mamba_block_step_triton import mamba_block_step_triton  # noqa: E402


def block_case(gen, b, d, h, hp, g, s, k, *, bias=False, d_per_channel=False, dt_limit=(0.0, float("inf")),
               residual=True, residual_in_fp32=True, norm_before_gate=False, groups=1):
    """Random inputs, states and weights of one block (``groups``: gated-norm groups over the SSM channels)."""
    d_ssm = h * hp
    c = d_ssm + 2 * g * s
    n_in = d_ssm + c + h

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    p = MambaBlockParams(
        norm_w=1.0 + 0.1 * rnd(d), norm_eps=1e-5, residual_in_fp32=residual_in_fp32,
        in_w=rnd(n_in, d, scale=d ** -0.5), in_b=rnd(n_in) if bias else None,
        conv_w=rnd(c, k, scale=0.5), conv_b=rnd(c) if bias else None, dt_bias=rnd(h), A=-torch.rand(h, generator=gen),
        D=rnd(d_ssm if d_per_channel else h), ngroups=g, dt_limit=dt_limit, gnorm_w=1.0 + 0.1 * rnd(d_ssm),
        group_size=d_ssm // groups, gnorm_eps=1e-5, norm_before_gate=norm_before_gate,
        out_w=rnd(d, d_ssm, scale=d_ssm ** -0.5), out_b=rnd(d) if bias else None,
    )
    x = rnd(b, d)
    res = rnd(b, d) if residual else None
    return x, res, p, rnd(b, c, k - 1), rnd(b, h, hp, s, scale=0.3)


CASES = [
    dict(b=1, d=32, h=4, hp=8, g=1, s=16, k=4),  # batch 1, one group
    dict(b=3, d=48, h=6, hp=24, g=2, s=20, k=3, bias=True, d_per_channel=True, dt_limit=(0.01, 0.8), groups=2),
    dict(b=2, d=40, h=2, hp=16, g=2, s=8, k=2, residual=False, residual_in_fp32=False, norm_before_gate=True),
]


@pytest.mark.parametrize("case", CASES, ids=["b1", "b3-bias-clamp-groups", "first-block-nbg"])
def test_block_step_matches_reference_and_updates_both_states(case):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, res, p, cs, hs = block_case(gen, **case)
    cs2, hs2 = cs.clone(), hs.clone()
    for launch in range(2):  # the second launch checks that the conv-roll counters were left at zero
        out1, r1 = mamba_block_step_ref(x, res, p, cs, hs)
        out2, r2 = mamba_block_step_triton(x, res, p, cs2, hs2, phased=True)
        assert rel_err(out2, out1) < 1e-4, launch
        assert r2.dtype == r1.dtype and rel_err(r2, r1) < 1e-6
        # the conv state holds in_proj's outputs: equal up to the projection's summation order
        assert rel_err(cs2, cs) < 1e-5 and rel_err(hs2, hs) < 1e-5
        x = out1


def test_persistent_form_with_its_barriers_matches_reference():
    """The one-launch form (both grid barriers and the counter reset), with the one program the interpreter can
    run through a barrier; twice, so the barrier words must have been left at zero."""
    from stree.kernels.mamba_block_step_triton import barrier_failed, sync_buffer

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, res, p, cs, hs = block_case(gen, b=2, d=32, h=4, hp=16, g=2, s=8, k=4, bias=True)
    cs2, hs2 = cs.clone(), hs.clone()
    for _ in range(2):
        out1, r1 = mamba_block_step_ref(x, res, p, cs, hs)
        out2, r2 = mamba_block_step_triton(x, res, p, cs2, hs2, phased=False)
        assert rel_err(out2, out1) < 1e-4 and rel_err(r2, r1) < 1e-6 and rel_err(hs2, hs) < 1e-5
    assert not barrier_failed(x.device)
    assert not sync_buffer(x.device, 0)[:4].any()


def test_block_step_tile_knobs_match_reference():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x, res, p, cs, hs = block_case(gen, b=2, d=24, h=3, hp=40, g=1, s=8, k=4)
    cs2, hs2 = cs.clone(), hs.clone()
    out1, _ = mamba_block_step_ref(x, res, p, cs, hs)
    out2, _ = mamba_block_step_triton(x, res, p, cs2, hs2, phased=True, block_p=8, num_warps=2)
    assert rel_err(out2, out1) < 1e-4 and rel_err(hs2, hs) < 1e-5


def test_block_step_refuses_mismatched_shapes():
    gen = torch.Generator().manual_seed(0)
    x, res, p, cs, hs = block_case(gen, b=2, d=16, h=2, hp=8, g=1, s=8, k=4)
    with pytest.raises(ValueError, match="conv_state"):
        mamba_block_step_triton(x, res, p, cs[:, :, :1], hs, phased=True)
    with pytest.raises(ValueError, match="in_proj"):
        mamba_block_step_triton(x, res, p._replace(in_w=p.in_w[:-1]), cs, hs, phased=True)
    with pytest.raises(ValueError, match="residual"):
        mamba_block_step_triton(x, res[:1], p, cs, hs, phased=True)
    with pytest.raises(ValueError, match="rows"):
        mamba_block_step_triton(torch.zeros(0, 16), None, p, cs[:0], hs[:0], phased=True)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_model_step_runs_each_mamba2_block_as_one_block_step(models, arch, monkeypatch):
    """With the Triton backend and ``STREE_BLOCK_STEP=fused`` a model's decode step runs each plain Mamba2 block
    as the block kernel (three phase launches on the interpreter, one persistent launch on a GPU) and no separate
    step kernel; logits and states equal the reference backend's over several steps."""
    from stree.bench.launches import count_launches

    monkeypatch.setenv("STREE_BLOCK_STEP", "fused")
    model = models[arch]
    blocks = sum(b.fusable_in_proj and b.mixer.block_fusable for b in model.backbone.layers)
    assert blocks > 0
    prompt = torch.randint(0, model.vocab_size, (3, 5))
    steps = torch.randint(0, model.vocab_size, (3, 3))

    def run():
        state = model.new_state(3, 32)
        model.prefill(prompt, state)
        with count_launches() as counts:
            logits = [model.step(steps[:, t], state) for t in range(steps.shape[1])]
        return logits, state, counts

    out = on_each_backend(run)
    for a, b in zip(out["triton"][0], out["torch"][0]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out["triton"][1].layers, out["torch"][1].layers):
        if hasattr(a, "ssm_state"):
            torch.testing.assert_close(a.ssm_state, b.ssm_state, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(a.conv_state, b.conv_state, atol=1e-4, rtol=1e-4)
    counts = out["triton"][2]
    assert counts["triton._mamba_block_step_kernel"] == 3 * 3 * blocks
    assert counts["triton._mamba_step_kernel"] == 0


def test_block_step_is_split_by_default_and_the_setting_is_checked(models, monkeypatch):
    """Unset, ``STREE_BLOCK_STEP`` keeps the three ops (the one launch measured slower); a bad value is refused."""
    from stree.bench.launches import count_launches
    from stree.kernels import backend

    model = models["mamba2"]
    state = model.new_state(1, 16)
    monkeypatch.delenv("STREE_BLOCK_STEP", raising=False)
    try:
        backend.use("triton")
        with count_launches() as counts:
            model.step(torch.tensor([1]), state)
        assert counts["triton._mamba_block_step_kernel"] == 0 and counts["triton._mamba_step_kernel"] > 0
        monkeypatch.setenv("STREE_BLOCK_STEP", "fastest")
        with pytest.raises(ValueError, match="STREE_BLOCK_STEP"):
            model.step(torch.tensor([1]), state)
    finally:
        backend.use(None)
