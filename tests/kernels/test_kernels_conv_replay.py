"""Tree conv1d and activation-replay Triton kernels vs their references (CPU interpreter, fp32)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import padded_batch, rel_err  # noqa: E402
from stree.bench.launches import count_launches  # noqa: E402
from stree.kernels.replay import replay_layers_ref, replay_ref  # noqa: E402
from stree.kernels.replay_triton import replay_layers_triton, replay_triton  # noqa: E402
from stree.kernels.tree_conv import tree_conv1d_ref, tree_conv_dt_ref  # noqa: E402
from stree.kernels.tree_conv_triton import tree_conv1d_triton, tree_conv_dt_triton  # noqa: E402


@pytest.mark.parametrize("width,with_bias", [(4, True), (2, False), (1, True)])
def test_tree_conv_matches_reference(width, with_bias):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("deep", 19), ("star", 6), ("bushy", 11)], gen)
    b, n = parents.shape
    c = 40
    xbc = torch.randn(b, n, c, generator=gen)
    state = torch.randn(b, c, width - 1, generator=gen)
    weight = torch.randn(c, width, generator=gen)
    bias = torch.randn(c, generator=gen) if with_bias else None
    before = state.clone()
    out = torch.full_like(xbc, float("nan"))
    tree_conv1d_triton(xbc, state, weight, bias, parents, out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, tree_conv1d_ref(xbc, state, weight, bias, parents)) < 1e-5
    assert torch.equal(state, before), "the tree conv must not change the committed state"


@pytest.mark.parametrize("block_c", [None, 32, 128])
@pytest.mark.parametrize("heads,dt_limit", [(3, (0.0, float("inf"))), (70, (0.05, 2.0))])
def test_tree_conv_with_dt_matches_reference(heads, dt_limit, block_c):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("deep", 19), ("bushy", 11)], gen)  # 19 nodes: two node blocks
    b, n = parents.shape
    c = 150  # two to five channel blocks, then one or two blocks of dt programs (64 heads each)
    xbc, state = torch.randn(b, n, c, generator=gen), torch.randn(b, c, 3, generator=gen)
    weight, bias = torch.randn(c, 4, generator=gen), torch.randn(c, generator=gen)
    wide = torch.randn(b, n, heads + 5, generator=gen) * 3  # dt_raw is a column slice, as from in_proj
    dt_raw, dt_bias = wide[..., 5:], torch.randn(heads, generator=gen)
    if block_c is None:
        out, dt = tree_conv_dt_triton(xbc, state, weight, bias, parents, dt_raw, dt_bias, dt_limit)
    else:
        out, dt = torch.full_like(xbc, float("nan")), torch.full(dt_raw.shape, float("nan"))
        tree_conv1d_triton(xbc, state, weight, bias, parents, out=out, dt=(dt_raw, dt_bias, dt_limit, dt),
                           block_c=block_c)
    ref_out, ref_dt = tree_conv_dt_ref(xbc, state, weight, bias, parents, dt_raw, dt_bias, dt_limit)
    assert rel_err(out, ref_out) < 1e-5 and rel_err(dt, ref_dt) < 1e-5 and dt.dtype == torch.float32
    with pytest.raises(ValueError, match="activation"):
        tree_conv_dt_triton(xbc, state, weight, bias, parents, dt_raw, dt_bias, dt_limit, "identity")


def test_tree_conv_chain_mode_is_prefill_conv():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("chain", 13)], gen)
    xbc = torch.randn(1, 13, 24, generator=gen)
    state = torch.randn(1, 24, 3, generator=gen)
    weight = torch.randn(24, 4, generator=gen)
    ref = tree_conv1d_ref(xbc, state, weight, None, parents)
    assert rel_err(tree_conv1d_triton(xbc, state, weight, None, None, is_chain=True), ref) < 1e-5


def _replay_case(gen, parents, paths):
    b, n = parents.shape
    h, p, g, s, c, k = 4, 8, 2, 16, 40, 4
    x = torch.randn(b, n, h, p, generator=gen)
    dt = torch.rand(b, n, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.1
    Bm = torch.randn(b, n, g, s, generator=gen)
    xbc = torch.randn(b, n, c, generator=gen)
    m = max(len(q) for q in paths) + 2  # padded past every path's length
    path = torch.tensor([q + [n - 1] * (m - len(q)) for q in paths])
    path_len = torch.tensor([len(q) for q in paths])
    ssm0 = torch.randn(b, h, p, s, generator=gen)
    conv0 = torch.randn(b, c, k - 1, generator=gen)
    s1, c1, s2, c2 = ssm0.clone(), conv0.clone(), ssm0.clone(), conv0.clone()
    replay_ref(s1, c1, x, dt, A, Bm, xbc, path, path_len)
    replay_triton(s2, c2, x, dt, A, Bm, xbc, path, path_len)
    assert rel_err(s2, s1) < 1e-5
    assert torch.equal(c2, c1)


def test_replay_paths_of_every_length():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("chain", 21), ("binary", 15), ("star", 9)], gen)
    # a 21-node path (two 16-node chunks), a 4-node path, and the root alone (conv keeps old rows)
    _replay_case(gen, parents, [list(range(21)), [0, 2, 6, 14], [0]])


def test_replay_short_paths_mix_old_and_new_conv_rows():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("bushy", 10), ("deep", 10)], gen)
    _replay_case(gen, parents, [[0, 3], [0, 1, 2]])


def test_replay_rejects_mismatched_shapes():
    x = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="ssm_state"):
        replay_triton(torch.zeros(1, 2, 4, 9), torch.zeros(1, 5, 3), x, torch.zeros(1, 3, 2), torch.zeros(2),
                      torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long),
                      torch.ones(1, dtype=torch.long))


@pytest.mark.parametrize("h, p, block_p", [(4, 8, None), (24, 40, None), (4, 8, 16)])
def test_replay_layers_commits_every_layer_in_one_launch(h, p, block_p):
    """Stacked ``[L, ...]`` states and activations, as the model lays them out (state rows a slice of a larger
    pool, x and B column slices of one post-conv tensor): one launch equals the per-layer reference."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    layers, b, n, g, s, k = 3, 3, 9, 2, 16, 4  # 24 heads x 3 rows: the 64-channel default tile over 40 channels
    c = h * p + 2 * g * s
    parents = padded_batch([("bushy", 9), ("chain", 6), ("binary", 7)], gen)
    paths = [[0, 1], list(range(6)), [0]]
    m = max(len(q) for q in paths) + 1
    path = torch.tensor([q + [0] * (m - len(q)) for q in paths])
    path_len = torch.tensor([len(q) for q in paths])
    assert parents.shape == (b, n)
    xbc = torch.randn(layers, b, n, c, generator=gen)
    x = xbc[..., : h * p].reshape(layers, b, n, h, p)
    Bm = xbc[..., h * p: h * p + g * s].reshape(layers, b, n, g, s)
    dt = torch.rand(layers, b, n, h, generator=gen)
    A = -torch.rand(layers, h, generator=gen) - 0.1
    pre = torch.randn(layers, b, n, c, generator=gen)
    pool_ssm = torch.randn(layers, b + 2, h, p, s, generator=gen)  # a larger slot pool: rows 1..b are ours
    pool_conv = torch.randn(layers, b + 2, c, k - 1, generator=gen)
    want_ssm, want_conv = pool_ssm.clone(), pool_conv.clone()
    replay_layers_ref(want_ssm[:, 1:b + 1], want_conv[:, 1:b + 1], x, dt, A, Bm, pre, path, path_len)
    with count_launches() as counted:
        replay_layers_triton(pool_ssm[:, 1:b + 1], pool_conv[:, 1:b + 1], x, dt, A, Bm, pre, path, path_len,
                             block_p=block_p)
    assert counted["triton._replay_kernel"] == 1
    assert rel_err(pool_ssm, want_ssm) < 1e-5
    assert torch.equal(pool_conv, want_conv)
    assert torch.equal(pool_ssm[:, 0], want_ssm[:, 0]) and torch.equal(pool_ssm[:, -1], want_ssm[:, -1])


def test_replay_layers_rejects_a_missing_layer_axis():
    x = torch.zeros(2, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="layer axis"):
        replay_layers_triton(torch.zeros(2, 1, 2, 4, 8), torch.zeros(2, 1, 24, 3), x, torch.zeros(2, 1, 3, 2),
                             torch.zeros(2), torch.zeros(2, 1, 3, 1, 8), torch.zeros(2, 1, 3, 24),
                             torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long))


def test_tree_conv_writes_the_pre_conv_copy_when_asked():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("bushy", 11), ("star", 4)], gen)
    xbc = torch.randn(2, 11, 40, generator=gen)
    pre = torch.full_like(xbc, float("nan"))
    state, weight = torch.randn(2, 40, 3, generator=gen), torch.randn(40, 4, generator=gen)
    out = tree_conv1d_triton(xbc, state, weight, None, parents, pre=pre)
    assert torch.equal(pre, xbc)
    assert rel_err(out, tree_conv1d_ref(xbc, state, weight, None, parents)) < 1e-5
