"""The exact numerics' Mamba2 tree pass, commit and prefill, on both backends (PyTorch references; Triton on the CPU
interpreter, fp32): a tree node's output is bit for bit what one-token decode steps along its path give, for every
tree shape; the commit leaves exactly the steps' states; a prompt's prefill does not depend on its batch or
padding. The Triton kernels are close to the references."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernel_trees import KINDS, padded_batch, rel_err  # noqa: E402
from stree.kernels.chunk_scan_triton import conv_prefill_triton, ssd_prefill_exact_triton  # noqa: E402
from stree.kernels.mamba_step import mamba_step_ref  # noqa: E402
from stree.kernels.mamba_step_triton import mamba_step_triton  # noqa: E402
from stree.kernels.replay_triton import replay_exact_triton  # noqa: E402
from stree.kernels.ssm_walk import (conv_prefill_exact_ref, replay_exact_ref, ssd_prefill_exact_ref,  # noqa: E402
                                    tree_conv_scan_exact_ref)
from stree.kernels.ssm_walk_triton import tree_conv_scan_exact_triton  # noqa: E402
from stree.kernels.tree_conv_scan import split_xbc  # noqa: E402

IMPLS = {
    "torch": (mamba_step_ref, tree_conv_scan_exact_ref, replay_exact_ref),
    "triton": (mamba_step_triton, tree_conv_scan_exact_triton, replay_exact_triton),
}
H, P, G, S, K = 4, 8, 2, 16, 4


def _layer(gen, d_per_channel: bool, dt_limit=(0.0, float("inf"))):
    c = H * P + 2 * G * S
    return dict(conv_w=torch.randn(c, K, generator=gen) * 0.5, conv_b=torch.randn(c, generator=gen) * 0.1,
                dt_bias=torch.rand(H, generator=gen) - 2.0, A=-torch.rand(H, generator=gen) - 0.2,
                D=torch.rand(H * P if d_per_channel else H, generator=gen) + 0.5, dt_limit=dt_limit)


def _path(parents: torch.Tensor, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = int(parents[node])
    return out[::-1]


def _tree_case(gen, state_dtype):
    specs = [(KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))], int(torch.randint(1, 8, (1,),
                                                                                                  generator=gen)))
             for _ in range(2)]
    parents = padded_batch(specs, gen)
    b, n = parents.shape
    c = H * P + 2 * G * S
    return (parents, torch.randn(b, n, c, generator=gen), torch.randn(b, n, H, generator=gen),
            torch.randn(b, c, K - 1, generator=gen), torch.randn(b, H, P, S, generator=gen).to(state_dtype))


@pytest.mark.parametrize("impl,state_dtype,d_per_channel", [
    ("torch", torch.float32, False), ("torch", torch.bfloat16, True),
    ("triton", torch.float32, False), ("triton", torch.float32, True),
])
def test_tree_nodes_and_commit_equal_decode_steps_along_the_path(impl, state_dtype, d_per_channel):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    step, tree, replay = IMPLS[impl]
    lay = _layer(gen, d_per_channel, (0.01, 2.0) if d_per_channel else (0.0, float("inf")))
    parents, xBC, dt_raw, conv0, ssm0 = _tree_case(gen, state_dtype)
    b, n = parents.shape
    w = (lay["conv_w"], lay["conv_b"], lay["dt_bias"], lay["A"], lay["D"], G, lay["dt_limit"])
    y, xbc, dt = tree(xBC, conv0, lay["conv_w"], lay["conv_b"], parents, dt_raw, lay["dt_bias"], lay["dt_limit"],
                      "silu", lay["A"], lay["D"], G, P, ssm0)
    for row in range(b):
        for node in range(n):
            conv, ssm = conv0[row:row + 1].clone(), ssm0[row:row + 1].clone()
            for v in _path(parents[row], node):
                y_step = step(conv, ssm, xBC[row:row + 1, v], dt_raw[row:row + 1, v], w[0], w[1], w[2], w[3], w[4],
                              w[5], w[6])
            assert torch.equal(y_step.reshape(H, P), y[row, node]), (impl, row, node)
    # commit a root-to-node path of each row: the states the steps leave
    ends = [int(torch.randint(0, n, (1,), generator=gen)) for _ in range(b)]
    paths = [_path(parents[row], e) for row, e in enumerate(ends)]
    width = max(len(p) for p in paths)
    path = torch.tensor([p + [0] * (width - len(p)) for p in paths])
    path_len = torch.tensor([len(p) for p in paths])
    x, Bm, _ = split_xbc(xbc, G, P, S)
    conv, ssm = conv0.clone(), ssm0.clone()
    replay(ssm, conv, x, dt, lay["A"], Bm, xBC, path, path_len)
    for row, p in enumerate(paths):
        c1, s1 = conv0[row:row + 1].clone(), ssm0[row:row + 1].clone()
        for v in p:
            step(c1, s1, xBC[row:row + 1, v], dt_raw[row:row + 1, v], *w)
        assert torch.equal(ssm[row:row + 1], s1) and torch.equal(conv[row:row + 1], c1), (impl, row)


def test_triton_walk_is_close_to_the_reference_and_splitting_nodes_changes_no_bit():
    from stree.kernels.ssm_walk_triton import tree_walk_triton

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lay = _layer(gen, False)
    parents, xBC, dt_raw, conv0, ssm0 = _tree_case(gen, torch.float32)
    args = (xBC, conv0, lay["conv_w"], lay["conv_b"], parents, dt_raw, lay["dt_bias"], lay["dt_limit"], "silu",
            lay["A"], lay["D"], G, P, ssm0)
    y_ref, xbc_ref, dt_ref = tree_conv_scan_exact_ref(*args)
    y, xbc, dt = tree_conv_scan_exact_triton(*args)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(xbc, xbc_ref) < 1e-5 and rel_err(dt, dt_ref) < 1e-6
    n = parents.shape[1]
    for split in (1, n):
        assert torch.equal(tree_walk_triton(xbc, dt, parents, lay["A"], lay["D"], ssm0, G, programs_per_tree=split),
                           y)
    chain = torch.arange(-1, n - 1).repeat(parents.shape[0], 1)
    y_chain = tree_walk_triton(xbc, dt, chain, lay["A"], lay["D"], ssm0, G, is_chain=True)
    assert torch.equal(y_chain, tree_walk_triton(xbc, dt, chain, lay["A"], lay["D"], ssm0, G))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_prefill_state_does_not_depend_on_the_batch_or_the_padding(impl):
    """A 20-token prompt alone, and as row 1 of three right-padded to 40 tokens (padding has dt = 0, as
    ``Mamba2Mixer.prefill`` gives it): the same outputs at its tokens and the same final SSM state."""
    ssd, conv = (ssd_prefill_exact_ref, conv_prefill_exact_ref) if impl == "torch" else \
        (ssd_prefill_exact_triton, conv_prefill_triton)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lay = _layer(gen, False)
    c = H * P + 2 * G * S
    t, wide = 20, 40
    xBC = torch.randn(3, wide, c, generator=gen)
    dt = torch.rand(3, wide, H, generator=gen) * 0.5
    dt[1, t:] = 0.0
    conv0 = torch.randn(3, c, K - 1, generator=gen)
    ssm0 = torch.randn(3, H, P, S, generator=gen)
    outs = []
    for rows, width in ((slice(1, 2), t), (slice(0, 3), wide)):
        cs, ss = conv0[rows].clone(), ssm0[rows].clone()
        xbc = conv(xBC[rows, :width], cs, lay["conv_w"], lay["conv_b"])
        x, Bm, Cm = split_xbc(xbc, G, P, S)
        y = ssd(x, dt[rows, :width], lay["A"], Bm, Cm, lay["D"], ss)
        outs.append((xbc, y, ss))
    (xbc1, y1, s1), (xbc3, y3, s3) = outs
    assert torch.equal(xbc3[1, :t], xbc1[0]) and torch.equal(y3[1, :t], y1[0]) and torch.equal(s3[1], s1[0])


def test_reference_prefill_equals_decode_steps():
    """The reference prefill is the step's recurrence, so a prompt prefilled equals its tokens stepped one by one."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    lay = _layer(gen, False)
    c = H * P + 2 * G * S
    xBC = torch.randn(2, 6, c, generator=gen)
    dt_raw = torch.randn(2, 6, H, generator=gen)
    conv0, ssm0 = torch.randn(2, c, K - 1, generator=gen), torch.randn(2, H, P, S, generator=gen)
    cs, ss = conv0.clone(), ssm0.clone()
    xbc = conv_prefill_exact_ref(xBC, cs, lay["conv_w"], lay["conv_b"])
    x, Bm, Cm = split_xbc(xbc, G, P, S)
    from stree.kernels.pointwise import dt_ref

    y = ssd_prefill_exact_ref(x, dt_ref(dt_raw, lay["dt_bias"]), lay["A"], Bm, Cm, lay["D"], ss)
    c1, s1 = conv0.clone(), ssm0.clone()
    for i in range(6):
        y_step = mamba_step_ref(c1, s1, xBC[:, i], dt_raw[:, i], lay["conv_w"], lay["conv_b"], lay["dt_bias"],
                                lay["A"], lay["D"], G)
        assert torch.equal(y_step.reshape(2, H, P), y[:, i])
    assert torch.equal(s1, ss) and torch.equal(c1, cs)
