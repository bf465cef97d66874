"""GPU, bf16 and fp16: every op of the exact numerics gives a row the same bits whatever the row count, offset, batch
or tree (the fast way to find a kernel that is not invariant): the GEMM at the Mamba2-2.7B shapes for every row
count 1..64 and larger, the norms and rotary, the decode step against the tree walk and the commit (fp32 and half
SSM states), and tree attention against decode steps at each node's position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stree.kernels.compare import rel_err
from stree.kernels.gemm_triton import gemm_triton
from stree.kernels.mamba_step_triton import mamba_step_triton
from stree.kernels.norms_triton import add_rmsnorm_triton, gated_rmsnorm_triton
from stree.kernels.replay_triton import replay_exact_triton
from stree.kernels.rotary import rotary_inv_freq
from stree.kernels.rotary_triton import rotary_triton
from stree.kernels.ssm_walk_triton import tree_conv_scan_exact_triton
from stree.kernels.tree_attention import tree_attention_ref
from stree.kernels.tree_attention_exact_triton import tree_attention_exact_triton
from stree.kernels.tree_conv_scan import split_xbc
from stree.protocols.token_tree import TokenTree, TreeBatch, ancestor_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # every dtype exact numerics covers
ROW_COUNTS = list(range(1, 65)) + [100, 517, 1000]


def gemm_row_failures(n: int, k: int, dtype, device="cuda", bias: bool = False, counts=ROW_COUNTS) -> list:
    """(row count, offset) pairs whose GEMM rows differ from the same rows of one 2048-row GEMM."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    w = (torch.randn(n, k, device=device, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device, generator=gen).to(dtype) if bias else None
    x = torch.randn(2048 + 64, k, device=device, generator=gen).to(dtype)
    full = gemm_triton(x, w, b)
    assert rel_err(full, F.linear(x.float(), w.float(), None if b is None else b.float())) < 1e-2
    return [(m, off) for m in counts for off in (0, 37)
            if not torch.equal(gemm_triton(x[off: off + m], w, b), full[off: off + m])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(10576, 2560, False), (2560, 5120, False), (50288, 2560, False),
                                      (200, 96, True)])
def test_gemm_every_row_count_gives_the_same_rows(dtype, n, k, bias):
    assert gemm_row_failures(n, k, dtype, bias=bias) == []


def test_gemm_fp32_every_row_count_gives_the_same_rows():
    assert gemm_row_failures(1000, 256, torch.float32, bias=True, counts=list(range(1, 40)) + [300]) == []


def norm_row_failures(dtype, device="cuda", d: int = 2560, rows: int = 1000, counts=range(1, 65)) -> list:
    """Row counts at which the add+RMSNorm, gated RMSNorm or rotary rows differ from a ``rows``-row call's."""
    gen = torch.Generator(device=device).manual_seed(1)
    x, r = torch.randn(rows, d, device=device, generator=gen).to(dtype), torch.randn(rows, d, device=device,
                                                                                       generator=gen)
    w = torch.rand(d, device=device, generator=gen).to(dtype) + 0.5
    y, z = torch.randn(rows, 2 * d, device=device, generator=gen).to(dtype), torch.randn(
        rows, 2 * d, device=device, generator=gen).to(dtype)
    w2 = torch.rand(2 * d, device=device, generator=gen).to(dtype) + 0.5
    q = torch.randn(1, rows, 32, 128, device=device, generator=gen).to(dtype)
    pos = torch.randint(0, 4000, (1, rows), device=device, generator=gen)
    inv = rotary_inv_freq(128, 10000.0, device)
    full = (add_rmsnorm_triton(x, r, w, 1e-5), gated_rmsnorm_triton(y, z, w2, 2 * d, 1e-5), rotary_triton(q, pos, inv,
                                                                                                         False))
    bad = []
    for m in counts:
        for off in (0, 11):
            s = slice(off, off + m)
            got = (add_rmsnorm_triton(x[s], r[s], w, 1e-5), gated_rmsnorm_triton(y[s], z[s], w2, 2 * d, 1e-5),
                   rotary_triton(q[:, s], pos[:, s], inv, False))
            same = (torch.equal(got[0][0], full[0][0][s]) and torch.equal(got[0][1], full[0][1][s])
                    and torch.equal(got[1], full[1][s]) and torch.equal(got[2], full[2][:, s]))
            if not same:
                bad.append((m, off))
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_rotary_rows_do_not_depend_on_the_row_count(dtype):
    assert norm_row_failures(dtype) == []


# ----- the SSM: decode steps, the tree walk and the commit ---------------------------------------------------------
LAYERS = {"2.7b": (80, 64, 128, 1), "small": (8, 32, 64, 2)}  # heads, headdim, d_state, groups
TREE_PARENTS = [
    list(range(-1, 15)),  # a chain of 16
    [-1] + [(i - 1) // 2 for i in range(1, 15)],  # binary, 15
    [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # beam 4x3, level by level
    [-1] + [0] * 8,  # star
    [-1, 0, 1, 1, 0, 4, 2, 6, 5, 3, 9, 9],  # bushy
]


def path_of(parents: list, node: int) -> list:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def ssm_layer(h, p, s, g, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    c = h * p + 2 * g * s
    return dict(conv_w=(torch.randn(c, 4, device=device, generator=gen) * 0.5).to(dtype),
                conv_b=(torch.randn(c, device=device, generator=gen) * 0.1).to(dtype),
                dt_bias=torch.rand(h, device=device, generator=gen) - 4.0,
                A=-(torch.rand(h, device=device, generator=gen) * 15 + 1),
                D=torch.rand(h, device=device, generator=gen) + 0.5, ngroups=g)


def steps_along_paths(lay, conv0, ssm0, xBC, dt_raw, parents: torch.Tensor):
    """Decode steps (``mamba_step_triton``) along every node's path, all (row, node) pairs stepped together one depth
    at a time: ``(y [B, N, H*P] at each node, conv [B, N, ...], ssm [B, N, ...] after it)``."""
    b, n = parents.shape
    paths = [[path_of(parents[r].tolist(), i) for i in range(n)] for r in range(b)]
    conv = conv0.repeat_interleave(n, 0).clone()
    ssm = ssm0.repeat_interleave(n, 0).clone()
    y = torch.empty(b * n, lay["conv_w"].shape[0] - 2 * lay["ngroups"] * ssm0.shape[-1], device=conv0.device,
                    dtype=xBC.dtype)
    for t in range(max(len(p) for row in paths for p in row)):
        live = [(r, i) for r in range(b) for i in range(n) if len(paths[r][i]) > t]
        idx = torch.tensor([r * n + i for r, i in live], device=conv0.device)
        rows = torch.tensor([r for r, _ in live], device=conv0.device)
        nodes = torch.tensor([paths[r][i][t] for r, i in live], device=conv0.device)
        c, s = conv[idx].contiguous(), ssm[idx].contiguous()
        yt = mamba_step_triton(c, s, xBC[rows, nodes], dt_raw[rows, nodes], lay["conv_w"], lay["conv_b"],
                               lay["dt_bias"], lay["A"], lay["D"], lay["ngroups"])
        conv[idx], ssm[idx] = c, s
        ends = torch.tensor([k for k, (r, i) in enumerate(live) if len(paths[r][i]) == t + 1], device=conv0.device)
        y[idx[ends]] = yt[ends]
    return y.view(b, n, -1), conv.view(b, n, *conv0.shape[1:]), ssm.view(b, n, *ssm0.shape[1:])


def walk_failures(layer: str, batch: int, dtype, state_dtype, device="cuda", seed=0) -> list:
    """(what, row, node) where the tree walk or the commit differs from decode steps along the path."""
    h, p, s, g = LAYERS[layer]
    lay = ssm_layer(h, p, s, g, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed)
    trees = [TokenTree.from_parents([0] * len(TREE_PARENTS[r % len(TREE_PARENTS)]), TREE_PARENTS[r % len(TREE_PARENTS)])
             for r in range(batch)]
    parents = TreeBatch.from_trees(trees).parents.to(device)
    b, n = parents.shape
    c = h * p + 2 * g * s
    dgen = torch.Generator(device=device).manual_seed(seed + 1)
    xBC = torch.randn(b, n, c, device=device, generator=dgen).to(dtype)
    dt_raw = torch.randn(b, n, h, device=device, generator=dgen).to(dtype)
    conv0 = torch.randn(b, c, 3, device=device, generator=dgen).to(dtype)
    ssm0 = torch.randn(b, h, p, s, device=device, generator=dgen).to(state_dtype)
    y, xbc, dt = tree_conv_scan_exact_triton(xBC, conv0, lay["conv_w"], lay["conv_b"], parents, dt_raw,
                                             lay["dt_bias"], (0.0, float("inf")), "silu", lay["A"], lay["D"], g, p,
                                             ssm0)
    y_steps, conv_steps, ssm_steps = steps_along_paths(lay, conv0, ssm0, xBC, dt_raw, parents)
    bad = [("y", r, i) for r in range(b) for i in range(n) if not torch.equal(y[r, i].reshape(-1), y_steps[r, i])]
    ends = [int(torch.randint(0, n, (1,), generator=gen)) for _ in range(b)]
    paths = [path_of(parents[r].tolist(), e) for r, e in enumerate(ends)]
    width = max(len(q) for q in paths)
    path = torch.tensor([q + [0] * (width - len(q)) for q in paths], device=device)
    plen = torch.tensor([len(q) for q in paths], device=device)
    x, Bm, _ = split_xbc(xbc, g, p, s)
    conv, ssm = conv0.clone(), ssm0.clone()
    replay_exact_triton(ssm, conv, x, dt, lay["A"], Bm, xBC, path, plen)
    bad += [("commit", r, e) for r, e in enumerate(ends)
            if not (torch.equal(ssm[r], ssm_steps[r, e]) and torch.equal(conv[r], conv_steps[r, e]))]
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state", ["float32", "half"])
@pytest.mark.parametrize("layer,batch", [("2.7b", 1), ("2.7b", 3), ("small", 64)])
def test_tree_walk_and_commit_equal_decode_steps(dtype, state, layer, batch):
    assert walk_failures(layer, batch, dtype, torch.float32 if state == "float32" else dtype) == []


# ----- attention ---------------------------------------------------------------------------------------------------
def attention_failures(batch: int, cache: int, heads: tuple, dtype, device="cuda", seed=0) -> list:
    """(row, node) whose tree attention differs from a decode step at its position: its committed keys and its
    path's keys contiguous in a cache of another size (another number of key slices)."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    trees = [TokenTree.from_parents([0] * len(TREE_PARENTS[r % len(TREE_PARENTS)]), TREE_PARENTS[r % len(TREE_PARENTS)])
             for r in range(batch)]
    parents = TreeBatch.from_trees(trees).parents
    b, n = parents.shape
    anc = ancestor_mask(parents).to(device)
    seqlen = torch.randint(0, cache - n, (b,), generator=gen)
    dgen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(b, n, hq, d, device=device, generator=dgen).to(dtype)
    k = torch.randn(b, cache, hkv, d, device=device, generator=dgen).to(dtype)
    v = torch.randn(b, cache, hkv, d, device=device, generator=dgen).to(dtype)
    out = tree_attention_exact_triton(q, k, v, seqlen.to(device), anc)
    assert rel_err(out, tree_attention_ref(q, k, v, seqlen.to(device), anc)) < 2e-2
    cap = cache + 600
    k2 = torch.zeros(b * n, cap, hkv, d, device=device, dtype=dtype)
    v2 = torch.zeros_like(k2)
    pos = torch.empty(b * n, dtype=torch.long)
    for r in range(b):
        sl = int(seqlen[r])
        for i in range(n):
            row = r * n + i
            k2[row, :sl], v2[row, :sl] = k[r, :sl], v[r, :sl]
            nodes = path_of(parents[r].tolist(), i)
            k2[row, sl: sl + len(nodes)], v2[row, sl: sl + len(nodes)] = k[r, sl + torch.tensor(nodes)], v[
                r, sl + torch.tensor(nodes)]
            pos[row] = sl + len(nodes) - 1
    one = torch.ones(b * n, 1, 1, dtype=torch.bool, device=device)
    step = tree_attention_exact_triton(q.reshape(b * n, 1, hq, d), k2, v2, pos.to(device), one, is_chain=True)
    return [(r, i) for r in range(b) for i in range(n) if not torch.equal(step[r * n + i, 0], out[r, i])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,cache,heads", [(1, 300, (32, 8, 128)), (3, 1500, (32, 8, 128)),
                                                (64, 700, (8, 2, 64))])
def test_tree_attention_node_equals_decode_step_at_its_position(dtype, batch, cache, heads):
    assert attention_failures(batch, cache, heads, dtype) == []
