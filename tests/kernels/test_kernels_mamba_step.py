"""The fused one-launch Mamba2 decode step vs its PyTorch reference (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import rel_err  # noqa: E402
from stree.kernels.decode_step import conv_step_ref, ssd_step_ref  # noqa: E402
from stree.kernels.mamba_step import mamba_step_ref  # noqa: E402
from stree.kernels.mamba_step_triton import mamba_step_triton  # noqa: E402


def _inputs(gen, b, h, p, g, s, k, d_per_channel):
    c = h * p + 2 * g * s
    return dict(
        conv_state=torch.randn(b, c, k - 1, generator=gen), ssm_state=torch.randn(b, h, p, s, generator=gen),
        xBC=torch.randn(b, c, generator=gen), dt_raw=torch.randn(b, h, generator=gen),
        conv_w=torch.randn(c, k, generator=gen) * 0.5, conv_b=torch.randn(c, generator=gen),
        dt_bias=torch.randn(h, generator=gen), A=-torch.rand(h, generator=gen),
        D=torch.randn(h * p if d_per_channel else h, generator=gen), ngroups=g,
    )


@pytest.mark.parametrize("b,h,p,g,s,k,d_per_channel,dt_limit", [
    (3, 4, 24, 2, 16, 4, False, (0.0, float("inf"))),  # batch > 1, two groups, two headdim blocks
    (2, 3, 8, 1, 20, 2, True, (0.01, 0.5)),  # one group, per-channel D, dt clamp, S not a power of 2
])
def test_fused_step_matches_reference_and_updates_both_states(b, h, p, g, s, k, d_per_channel, dt_limit):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    ref = _inputs(gen, b, h, p, g, s, k, d_per_channel)
    tri = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in ref.items()}
    y1 = mamba_step_ref(**ref, dt_limit=dt_limit)
    y2 = torch.full_like(y1, float("nan"))
    for _ in range(2):  # the second launch checks the arrival counters were reset
        y2 = mamba_step_triton(**tri, dt_limit=dt_limit, out=y2)
        if _ == 0:
            assert rel_err(y2, y1) < 1e-5
            assert torch.equal(tri["conv_state"], ref["conv_state"])
            assert rel_err(tri["ssm_state"], ref["ssm_state"]) < 1e-5
            y1 = mamba_step_ref(**ref, dt_limit=dt_limit)
    assert rel_err(y2, y1) < 1e-5
    assert torch.equal(tri["conv_state"], ref["conv_state"])


def test_reference_equals_the_unfused_conv_then_ssd_step():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, h, p, g, s = 2, 4, 8, 2, 16
    a = _inputs(gen, b, h, p, g, s, 4, False)
    cs, hs = a["conv_state"].clone(), a["ssm_state"].clone()
    xbc = conv_step_ref(cs, a["xBC"], a["conv_w"], a["conv_b"])
    x, Bm, Cm = xbc.split([h * p, g * s, g * s], -1)
    dt = torch.nn.functional.softplus(a["dt_raw"] + a["dt_bias"])
    y_unfused = ssd_step_ref(hs, x.reshape(b, h, p), dt, a["A"], Bm.reshape(b, g, s), Cm.reshape(b, g, s), a["D"])
    y = mamba_step_ref(**a)
    assert rel_err(y, y_unfused.reshape(b, -1)) < 1e-5
    assert torch.equal(a["conv_state"], cs) and rel_err(a["ssm_state"], hs) < 1e-5


def test_kernel_refuses_other_activations():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="activation"):
        mamba_step_triton(**_inputs(gen, 1, 2, 4, 1, 8, 4, False), activation="identity")


@pytest.mark.parametrize("block_p, num_warps", [(8, 2), (32, 4), (None, 8)])
def test_tile_knobs_and_the_large_batch_default_match_reference(block_p, num_warps):
    """Other headdim tiles and warp counts, and the 32-channel default that >= 256 (sequence, head) pairs get."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, h = (64, 4) if block_p is None else (2, 3)  # 256 pairs: the large-batch default tile
    ref = _inputs(gen, b, h, 40, 1, 8, 4, False)
    tri = {n: (v.clone() if torch.is_tensor(v) else v) for n, v in ref.items()}
    y1 = mamba_step_ref(**ref)
    y2 = mamba_step_triton(**tri, block_p=block_p, num_warps=num_warps)
    assert rel_err(y2, y1) < 1e-5
    assert rel_err(tri["ssm_state"], ref["ssm_state"]) < 1e-5
    assert torch.equal(tri["conv_state"], ref["conv_state"])


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("b_in,rows,with_src", [(2, 5, True), (4, 4, True), (3, 3, False)])
def test_out_of_place_step_from_source_rows_is_gather_then_step(impl, b_in, rows, with_src):
    """Row i stepping row ``src_rows[i]`` into new states (rows repeat, as beams sharing a parent) equals gathering
    those rows and stepping them in place; the states it reads are left unchanged."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    h, p, g, s = 4, 24, 2, 16
    a = _inputs(gen, b_in, h, p, g, s, 4, False)
    per_row = _inputs(gen, rows, h, p, g, s, 4, False)
    a["xBC"], a["dt_raw"] = per_row["xBC"], per_row["dt_raw"]
    src = torch.randint(0, b_in, (rows,), generator=gen) if with_src else None
    gathered = dict(a, conv_state=a["conv_state"][src].clone() if with_src else a["conv_state"].clone(),
                    ssm_state=a["ssm_state"][src].clone() if with_src else a["ssm_state"].clone())
    y_want = mamba_step_ref(**gathered)
    before = a["conv_state"].clone(), a["ssm_state"].clone()
    new = (torch.full_like(gathered["conv_state"], float("nan")), torch.full_like(gathered["ssm_state"], float("nan")))
    step = mamba_step_ref if impl == "reference" else mamba_step_triton
    for _ in range(2):  # the triton kernel's in-place counters are not touched by this mode: run it twice
        y = step(**a, src_rows=src, new_states=new)
    assert rel_err(y, y_want) < 1e-5
    assert torch.equal(new[0], gathered["conv_state"]) and rel_err(new[1], gathered["ssm_state"]) < 1e-5
    assert torch.equal(a["conv_state"], before[0]) and torch.equal(a["ssm_state"], before[1])


@pytest.mark.parametrize("impl", [mamba_step_ref, mamba_step_triton])
def test_out_of_place_step_rejects_what_cannot_run(impl):
    gen = torch.Generator().manual_seed(3)
    a = _inputs(gen, 2, 2, 8, 1, 8, 4, False)
    new = (torch.zeros_like(a["conv_state"]), torch.zeros_like(a["ssm_state"]))
    with pytest.raises(ValueError, match="needs new_states"):
        impl(**a, src_rows=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="must not be the states it reads"):
        impl(**a, new_states=(a["conv_state"], new[1]))
    with pytest.raises(ValueError, match="name rows"):
        impl(**a, src_rows=torch.tensor([0, 2]), new_states=new)
    with pytest.raises(ValueError, match="integers"):
        impl(**a, src_rows=torch.tensor([0.0, 1.0]), new_states=new)
    with pytest.raises(ValueError, match="new_states"):
        impl(**a, new_states=(new[0][:1], new[1][:1]))
