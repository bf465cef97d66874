"""Keyed uniforms (``kernels.keyed_random``): the hash is lowbias32 (checked against plain Python integers), the
Triton kernel (interpreter) gives the reference's bits, a row's draws depend on its seed, step and lane alone, and
the numbers are uniform and uncorrelated enough for sampling (chi-square and correlation checks that a biased or
repeating generator fails)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from stree.kernels import ops  # noqa: E402
from stree.kernels.keyed_random import (ACCEPT_LANE, BONUS_LANE, DRAFT_LANE, keyed_uniform_ref, mix32,  # noqa: E402
                                        row_keys)
from stree.kernels.keyed_random_triton import keyed_uniform_triton  # noqa: E402
from stree.protocols.sampling import RowSampling  # noqa: E402
from stat_helpers import chisquare_pvalue  # noqa: E402


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50))
@settings(max_examples=30, deadline=None)
def test_mix32_is_lowbias32_on_every_32_bit_value(xs):
    assert mix32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs] == [mix32(x) for x in xs]


@given(st.lists(st.tuples(st.integers(-2**63, 2**63 - 1), st.integers(0, 2**40)), min_size=1, max_size=6),
       st.integers(1, 2500), st.sampled_from([ACCEPT_LANE, BONUS_LANE, DRAFT_LANE + 3]))
@settings(max_examples=12, deadline=None)
def test_triton_kernel_gives_the_reference_bits(rows, n, lane):
    seed = torch.tensor([r[0] for r in rows])
    step = torch.tensor([r[1] for r in rows])
    want = keyed_uniform_ref(seed, step, lane, n)
    assert torch.equal(keyed_uniform_triton(seed, step, lane, n), want)
    assert bool(((want > 0) & (want < 1)).all())
    keys = row_keys(seed, step, lane)  # the reference's definition, spelled out for row 0
    a, b = int(keys[0, 0]), int(keys[0, 1])
    first = [(mix32(mix32(a ^ i) ^ b) >> 9) for i in range(min(n, 5))]
    assert want[0, :5].tolist() == [(h + 0.5) / 2**23 for h in first]  # exact in float32


def test_a_rows_draws_depend_on_its_own_seed_step_and_lane_only():
    """Row 2 alone, and the same (seed, step) at another slot among other rows, give the same bits; another step,
    lane or seed gives other numbers."""
    seed, step = torch.tensor([5, 9, 12345, 7]), torch.tensor([0, 3, 41, 2])
    full = ops.keyed_uniform(seed, step, BONUS_LANE, 300)
    alone = ops.keyed_uniform(seed[2:3], step[2:3], BONUS_LANE, 300)
    moved = ops.keyed_uniform(torch.tensor([1, 2, 12345]), torch.tensor([8, 8, 41]), BONUS_LANE, 300)
    assert torch.equal(alone[0], full[2]) and torch.equal(moved[2], full[2])
    for s, t, lane in ((12345, 42, BONUS_LANE), (12345, 41, ACCEPT_LANE), (12346, 41, BONUS_LANE)):
        other = ops.keyed_uniform(torch.tensor([s]), torch.tensor([t]), lane, 300)[0]
        assert not torch.equal(other, full[2])


def test_draws_are_uniform_and_uncorrelated_across_elements_steps_and_seeds():
    """Chi-square on 64 bins over 256k draws, and the correlation of neighbours along each axis (index, step,
    seed); a generator that repeats across steps or clusters by seed fails these."""
    rows = 512
    sampling = RowSampling.greedy(rows, "cpu")
    sampling.seed.copy_(torch.arange(rows))
    u = ops.keyed_uniform(sampling.seed, sampling.step, DRAFT_LANE, 512)
    bins = (u * 64).long().flatten().tolist()
    assert chisquare_pvalue(bins, {b: 1.0 for b in range(64)}) > 1e-4
    sampling.advance()
    nxt = ops.keyed_uniform(sampling.seed, sampling.step, DRAFT_LANE, 512)
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, nxt)):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(corr)) < 5 / a.numel() ** 0.5


def test_the_extreme_hashes_stay_inside_the_open_interval():
    from stree.kernels.keyed_random import to_uniform

    u = to_uniform(torch.tensor([0, 2**32 - 1]))
    assert u.tolist() == [2.0 ** -24, 1 - 2.0 ** -24] and bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_row_sampling_takes_any_integer_seed_modulo_2_64():
    sampling = RowSampling.greedy(3, "cpu")
    sampling.start(0, 2**64 + 5)
    sampling.start(1, -1)
    sampling.start(2, 5)
    assert sampling.seed.tolist() == [5, -1, 5] and sampling.step.tolist() == [0, 0, 0]
    sampling.advance()
    assert sampling.step.tolist() == [1, 1, 1]
    with pytest.raises(TypeError):
        sampling.start(0, "5")
