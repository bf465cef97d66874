"""GPU-only checks (skipped without CUDA; run on the device machine): kernels + CUDA graphs keep output exact."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.kernels import backend, numerics
from stree.verifier.model.checkpoint import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def fast_numerics():
    """The per-shape timed projections and norm fusions run in fast numerics only."""
    numerics.use("fast")
    yield
    numerics.use(None)


def _load(path, dtype):
    model = load_model(path, device="cuda", dtype=dtype)
    with torch.no_grad():  # peaked distributions: fewer near-ties, a sharper test
        model.backbone.norm_f.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_graphed_triton_greedy_equals_plain_greedy_fp32(gpu_models, arch):
    backend.use("triton")
    try:
        target = _load(gpu_models[arch], torch.float32)
        draft = _load(gpu_models["draft"], torch.float32)
        for prompt in ([1, 2, 3], list(range(40, 90))):
            plain = stree.generate(target, prompt, max_new_tokens=48, cuda_graphs=False).token_ids
            plain_g = stree.generate(target, prompt, max_new_tokens=48).token_ids
            assert plain_g == plain
            for drafter, opts, d in [("chain", {}, target), ("static-tree", {"tree_widths": "3,2,2,1"}, draft),
                                     ("mamba", {"tree": "beam:4x3"}, target), ("ngram", {}, None)]:
                got = stree.generate(target, prompt, drafter=drafter, draft_model=d, max_new_tokens=48, **opts)
                assert got.token_ids == plain, (arch, drafter)
    finally:
        backend.use(None)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_graphs_do_not_change_bf16_results(gpu_models, arch):
    target = _load(gpu_models[arch], torch.bfloat16)
    prompt = list(range(7, 30))
    for drafter, d in [(None, None), ("chain", target)]:
        eager = stree.generate(target, prompt, drafter=drafter, draft_model=d, max_new_tokens=40, cuda_graphs=False)
        graph = stree.generate(target, prompt, drafter=drafter, draft_model=d, max_new_tokens=40)
        assert graph.token_ids == eager.token_ids


def test_graphed_beam_draft_equals_eager_beam_draft(gpu_models):
    from stree import DraftBudget, SamplingParams
    from stree.drafter_service.drafters.mamba.drafter import MambaDrafter

    draft = _load(gpu_models["draft"], torch.float32)
    budget = DraftBudget(max_nodes=64, max_depth=8, max_width=8)
    context = list(range(3, 40))
    trees = []
    for graphs in (True, False):
        session = MambaDrafter(draft, "beam:4x3", cuda_graphs=graphs).open(context, SamplingParams())
        got = [session.draft(budget)]
        session.commit([7, 8, 9])
        got.append(session.draft(budget))
        trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in got])
    assert trees[0] == trees[1]


@pytest.mark.parametrize("spec, temperature", [("chain:4", 0.0), ("static:3,2,1", 0.0), ("chain:4", 1.0),
                                               ("static:3,1,1,1", 1.0)])
def test_graphed_static_draft_equals_eager_static_draft(gpu_models, spec, temperature):
    from stree import DraftBudget, SamplingParams
    from stree.drafter_service.drafters.mamba.drafter import MambaDrafter

    draft = _load(gpu_models["draft"], torch.float32)
    budget = DraftBudget(max_nodes=64, max_depth=8, max_width=8)
    params = SamplingParams(temperature=temperature, seed=3)
    trees = []
    for graphs in (True, False):
        session = MambaDrafter(draft, spec, cuda_graphs=graphs).open(list(range(3, 40)), params)
        got = [session.draft(budget)]
        session.commit([7, 8, 9])
        got.append(session.draft(budget))
        trees.append([(t.tokens.tolist(), t.parents.tolist()) for t in got])
    assert trees[0] == trees[1]



@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_row_padded_linear_matches_cublas(dtype, tol, fast_numerics):
    """ops.linear (row padding or the Triton kernel, chosen by timing) equals F.linear on fresh inputs at
    every few-row count, and remembers its choice per (rows, weight shape, dtype); so does the Triton
    kernel called directly."""
    from stree.kernels import ops
    from stree.kernels.linear import PAD_ROWS, TRITON, row_choices
    from stree.kernels.linear_rows_triton import linear_rows_triton

    g = torch.Generator(device="cuda").manual_seed(11)
    for k, n in ((256, 1160), (512, 256)):
        w = torch.randn(n, k, device="cuda", generator=g).to(dtype) / k ** 0.5
        b = torch.randn(n, device="cuda", generator=g).to(dtype)
        for m in (1, 2, 5, 13, 21, PAD_ROWS[-1]):
            x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
            with torch.no_grad():
                got = ops.linear(x, w, b)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=tol, rtol=tol)
            torch.testing.assert_close(linear_rows_triton(x, w, b), torch.nn.functional.linear(x, w, b),
                                       atol=tol, rtol=tol)
            if 1 <= m < PAD_ROWS[-1]:
                assert row_choices()[(m, (n, k), str(dtype).removeprefix("torch."))] in (m,) + PAD_ROWS + (TRITON,)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_norm_linear_fusions_match_reference(dtype, tol, fast_numerics):
    """ops.add_rmsnorm_linear / ops.gated_rmsnorm_linear (fused or not, chosen by timing) and the fused Triton
    kernels called directly equal the references, at the demo pair's and the 2.7B shape's projections."""
    from stree.kernels import ops
    from stree.kernels.compare import rel_err
    from stree.kernels.linear_rows_triton import add_rmsnorm_linear_rows_triton, gated_rmsnorm_linear_rows_triton
    from stree.kernels.norm_linear import add_rmsnorm_linear_ref, fused_choices, gated_rmsnorm_linear_ref

    g = torch.Generator(device="cuda").manual_seed(12)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", generator=g).to(dt)

    for d_model, d_in, n_in, groups in ((256, 512, 1160, 1), (2560, 5120, 10576, 1), (256, 512, 1160, 4)):
        w_in, w_out = rand(n_in, d_model) / d_model ** 0.5, rand(d_model, d_in) / d_in ** 0.5
        nw_in, nw_out = rand(d_model).abs() + 0.5, rand(d_in).abs() + 0.5
        for m in (1, 4, 13):
            x, r, y, z = rand(m, d_model), rand(m, d_model, dt=torch.float32), rand(m, d_in), rand(m, d_in)
            want, want_r = add_rmsnorm_linear_ref(x, r, nw_in, 1e-5, True, w_in)
            with torch.no_grad():
                got, got_r = ops.add_rmsnorm_linear(x, r, nw_in, 1e-5, True, w_in)
            direct, direct_r = add_rmsnorm_linear_rows_triton(x, r, nw_in, 1e-5, True, w_in)
            assert rel_err(got, want) < tol and rel_err(direct, want) < tol
            torch.testing.assert_close(got_r, want_r)
            torch.testing.assert_close(direct_r, want_r)
            gs = d_in // groups
            want = gated_rmsnorm_linear_ref(y, z, nw_out, gs, 1e-5, False, w_out)
            with torch.no_grad():
                got = ops.gated_rmsnorm_linear(y, z, nw_out, gs, 1e-5, False, w_out)
            assert rel_err(got, want) < tol
            assert rel_err(gated_rmsnorm_linear_rows_triton(y, z, nw_out, gs, 1e-5, False, w_out), want) < tol
    assert fused_choices()  # the choice was timed and remembered


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, headdim, d_state, ngroups", [(8, 64, 64, 1), (80, 64, 128, 1), (8, 32, 48, 2)])
def test_fused_tree_conv_scan_matches_reference(dtype, tol, heads, headdim, d_state, ngroups):
    """The one-launch tree conv + dt + scan equals its reference on random trees (NaN-poisoned outputs)."""
    from stree.kernels.compare import rel_err
    from stree.kernels.tree_conv_scan import tree_conv_scan_ref
    from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton

    g = torch.Generator(device="cuda").manual_seed(heads + d_state)
    b, n, k = 3, 21, 4
    c = heads * headdim + 2 * ngroups * d_state
    parents = torch.stack([torch.cat([torch.tensor([-1]), torch.randint(0, 10**9, (n - 1,)) % torch.arange(1, n)])
                           for _ in range(b)]).cuda()
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    args = (rnd(b, n, c), rnd(b, c, k - 1), rnd(c, k, scale=0.5), rnd(c), parents, rnd(b, n, heads) - 3.0,
            rnd(heads), (0.0, float("inf")), "silu",
            -torch.exp(torch.rand(heads, device="cuda", generator=g) * 2.7), torch.randn(heads, device="cuda", generator=g),
            ngroups, headdim, torch.randn(b, heads, headdim, d_state, device="cuda", generator=g) * 0.5)
    want = tree_conv_scan_ref(*args)
    outs = tuple(torch.full_like(w, float("nan")) for w in want)
    tree_conv_scan_triton(*args, out=outs, max_fused_nodes=64)  # the kernel itself, past its default routing
    for got, ref in zip(outs, want):
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < (1e-5 if ref.dtype == torch.float32 and got is outs[2] else tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, headdim, d_state, batch, n", [(8, 64, 64, 1, 5), (80, 64, 128, 1, 5), (80, 64, 128, 4, 3),
                                                               (8, 32, 48, 3, 8)])
def test_chain_conv_scan_matches_reference(dtype, tol, heads, headdim, d_state, batch, n):
    """The sequential chain kernel equals the reference on chains, NaN-poisoned outputs, with the xBC copy."""
    from stree.bench.launches import count_launches
    from stree.kernels.compare import rel_err
    from stree.kernels.tree_conv_scan import tree_conv_scan_ref
    from stree.kernels.tree_conv_scan_triton import tree_conv_scan_triton

    g = torch.Generator(device="cuda").manual_seed(heads * n + batch)
    c = heads * headdim + 2 * d_state
    rnd = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    parents = (torch.arange(n, device="cuda") - 1).expand(batch, n).contiguous()
    args = (rnd(batch, n, c), rnd(batch, c, 3), rnd(c, 4, scale=0.5), rnd(c), parents, rnd(batch, n, heads) - 3.0,
            rnd(heads), (0.0, float("inf")), "silu",
            -torch.exp(torch.rand(heads, device="cuda", generator=g) * 2.7), torch.randn(heads, device="cuda", generator=g),
            1, headdim, torch.randn(batch, heads, headdim, d_state, device="cuda", generator=g) * 0.5)
    want = tree_conv_scan_ref(*args)
    outs = tuple(torch.full_like(w, float("nan")) for w in want)
    pre = torch.full_like(args[0], float("nan"))
    with count_launches() as launched:
        tree_conv_scan_triton(*args, out=outs, pre=pre, is_chain=True, chain_max_nodes=8)
    assert launched["triton._chain_conv_scan_kernel"] == 1
    for got, ref in zip(outs, want):
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) < (1e-5 if ref.dtype == torch.float32 and got is outs[2] else tol)
    assert torch.equal(pre, args[0])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch, length", [(1, 130), (16, 77)])
def test_chunked_prefill_scan_matches_reference(dtype, tol, batch, length):
    """Our prefill scan (64-token chunks; fp32 in 32-node tiles, half in one tile) against the fp32 reference."""
    from stree.kernels.chunk_scan import ssd_prefill_ref
    from stree.kernels.chunk_scan_triton import ssd_prefill_triton

    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + length)
    h, p, s = 8, 64, 64
    x = torch.randn(batch, length, h, p, device="cuda", generator=g).to(dtype)
    dt = torch.rand(batch, length, h, device="cuda", generator=g) * 0.2
    A = -torch.rand(h, device="cuda", generator=g)
    Bm = torch.randn(batch, length, 1, s, device="cuda", generator=g).to(dtype)
    Cm = torch.randn(batch, length, 1, s, device="cuda", generator=g).to(dtype)
    D = torch.randn(h, device="cuda", generator=g)
    state = (torch.randn(batch, h, p, s, device="cuda", generator=g) * 0.1).to(dtype)
    ref_state = state.float().clone()
    ref = ssd_prefill_ref(x.float(), dt, A, Bm.float(), Cm.float(), D, ref_state)
    ours = state.clone()
    y = ssd_prefill_triton(x, dt, A, Bm, Cm, D, ours, use_mamba_ssm=False)
    assert not y.isnan().any()
    scale = ref.abs().max()
    assert (y.float() - ref).abs().max() <= tol * scale
    assert (ours.float() - ref_state).abs().max() <= tol * ref_state.abs().max()


@pytest.mark.parametrize("dtype, state_dtype, tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 1e-2)])
def test_replay_layers_and_stacked_acts_match_reference(dtype, state_dtype, tol):
    """The whole-model commit in one launch (2.7B layer shape, 4 layers, bf16 state too) equals the per-layer
    reference; the fused tree pass writes the commit's copy of xBC into its layer's slice of the stack."""
    from stree.kernels import ops
    from stree.kernels.compare import rel_err
    from stree.kernels.replay import replay_layers_ref
    from stree.kernels.replay_triton import replay_layers_triton

    g = torch.Generator(device="cuda").manual_seed(7)
    layers, b, n, h, p, s, k = 4, 3, 9, 80, 64, 128, 4
    c = h * p + 2 * s
    xbc = torch.randn(layers, b, n, c, device="cuda", generator=g).to(dtype)
    x, Bm = xbc[..., : h * p].reshape(layers, b, n, h, p), xbc[..., h * p: h * p + s].reshape(layers, b, n, 1, s)
    dt = torch.rand(layers, b, n, h, device="cuda", generator=g) * 0.2
    A = -torch.rand(layers, h, device="cuda", generator=g)
    pre = torch.randn(layers, b, n, c, device="cuda", generator=g).to(dtype)
    path = torch.tensor([[0, 1, 3, 7], [0, 2, 0, 0], [0, 0, 0, 0]], device="cuda")
    path_len = torch.tensor([4, 2, 1], device="cuda")
    ssm = (torch.randn(layers, b, h, p, s, device="cuda", generator=g) * 0.3).to(state_dtype)
    conv = torch.randn(layers, b, c, k - 1, device="cuda", generator=g).to(dtype)
    want_ssm, want_conv = ssm.clone(), conv.clone()
    replay_layers_ref(want_ssm, want_conv, x, dt, A, Bm, pre, path, path_len)
    replay_layers_triton(ssm, conv, x, dt, A, Bm, pre, path, path_len)
    assert rel_err(ssm.float(), want_ssm.float()) < tol and torch.equal(conv, want_conv)

    parents = torch.tensor([[-1, 0, 1, 1, 2, 3, 0, 6, 7]] * b, device="cuda")
    args = (pre[1], conv[1], torch.randn(c, k, device="cuda", generator=g).to(dtype) * 0.5, None, parents,
            torch.randn(b, n, h, device="cuda", generator=g).to(dtype) - 3.0, torch.zeros(h, device="cuda"),
            (0.0, float("inf")), "silu", A[1], torch.ones(h, device="cuda"), 1, p, ssm[1])
    stack = [torch.full_like(xbc, float("nan")), torch.full_like(dt, float("nan")), torch.full_like(pre, float("nan"))]
    backend.use("triton")
    try:
        y, got_xbc, got_dt = ops.tree_conv_scan(*args, acts_out=tuple(t[2] for t in stack))
        y_plain, xbc_plain, dt_plain = ops.tree_conv_scan(*args)
    finally:
        backend.use(None)
    assert torch.equal(stack[2][2], pre[1]) and torch.equal(got_xbc, xbc_plain) and torch.equal(got_dt, dt_plain)
    assert torch.equal(y, y_plain) and all(torch.isnan(t[0]).all() for t in stack)


def test_half_ssm_state_graphed_equals_eager(gpu_models):
    """A bf16 SSM state (``mamba_ssm_cache_dtype="auto"`` on a bf16 model): graphs change nothing."""
    target = _load(gpu_models["mamba2"], torch.bfloat16)
    target.set_mamba_ssm_cache_dtype("auto")
    prompt = list(range(7, 30))
    for drafter, d in [(None, None), ("chain", target)]:
        eager = stree.generate(target, prompt, drafter=drafter, draft_model=d, max_new_tokens=40, cuda_graphs=False)
        graph = stree.generate(target, prompt, drafter=drafter, draft_model=d, max_new_tokens=40)
        assert graph.token_ids == eager.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,nodes", [(4, 4, 1), (4, 4, 5), (4, 4, 16), (32, 8, 1), (32, 8, 5)])
def test_tree_attention_matches_reference_at_few_rows(dtype, hq, hkv, nodes):
    """The split-keys kernel at its defaults (16-row tile for few rows, 64-key slices) against the reference
    in float64, NaN-poisoned, at decode and small-tree row counts and a few hundred to a thousand keys."""
    from stree.kernels.compare import rel_err
    from stree.kernels.tree_attention import tree_attention_ref
    from stree.kernels.tree_attention_triton import tree_attention_triton
    from stree.protocols.token_tree import ancestor_mask

    gen = torch.Generator(device="cuda").manual_seed(hq * 100 + nodes)
    b, cache, d = 3, 1104, 64 if hq == 4 else 128
    parents = torch.randint(0, 1, (b, nodes), device="cuda")
    for i in range(1, nodes):
        parents[:, i] = torch.randint(0, i, (b,), device="cuda", generator=gen)
    parents[:, 0] = -1
    anc = ancestor_mask(parents)
    q = torch.randn(b, nodes, hq, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(b, cache, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(b, cache, hkv, d, device="cuda", generator=gen).to(dtype)
    seqlen = torch.tensor([0, 290, 1000 - nodes], device="cuda")
    ref = tree_attention_ref(q.double(), k.double(), v.double(), seqlen, anc)
    out = torch.full_like(q, float("nan"))
    tree_attention_triton(q, k, v, seqlen, anc, out=out)
    assert rel_err(out.double(), ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype, state_dtype, tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.float32, 2e-2),
                                                     (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b_in, rows", [(1, 3), (4, 12)])
def test_step_from_source_rows_matches_gather_then_step(dtype, state_dtype, tol, b_in, rows):
    """The out-of-place decode step (beams kept in place by index) at the Mamba2-130M layer shape, NaN-poisoned
    outputs, against the reference stepping gathered rows in place; the states it reads stay unchanged."""
    from stree.kernels.compare import rel_err
    from stree.kernels.mamba_step import mamba_step_ref
    from stree.kernels.mamba_step_triton import mamba_step_triton

    g = torch.Generator(device="cuda").manual_seed(rows)
    h, p, s, k = 24, 64, 128, 4
    c = h * p + 2 * s
    def rnd(*size, scale=1.0, dt=dtype):
        return (torch.randn(*size, device="cuda", generator=g) * scale).to(dt)

    conv, ssm = rnd(b_in, c, k - 1), rnd(b_in, h, p, s, scale=0.5, dt=state_dtype)
    args = dict(xBC=rnd(rows, c), dt_raw=rnd(rows, h) - 3.0, conv_w=rnd(c, k, scale=0.5), conv_b=rnd(c),
                dt_bias=rnd(h), A=-torch.rand(h, device="cuda", generator=g),
                D=torch.randn(h, device="cuda", generator=g), ngroups=1)
    src = torch.randint(0, b_in, (rows,), device="cuda", generator=g)
    want_conv, want_ssm = conv[src].clone(), ssm[src].clone()
    want = mamba_step_ref(want_conv, want_ssm, **args)
    new = (torch.full_like(want_conv, float("nan")), torch.full_like(want_ssm, float("nan")))
    before = conv.clone(), ssm.clone()
    got = mamba_step_triton(conv, ssm, **args, src_rows=src, new_states=new)
    assert torch.isfinite(got).all() and torch.isfinite(new[1]).all()
    assert rel_err(got, want) < tol and rel_err(new[1], want_ssm) < tol and torch.equal(new[0], want_conv)
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n, block_c", [(32, None), (32, 128), (16, 64), (300, None)])
def test_tree_conv_tiles_match_reference(dtype, tol, n, block_c):
    """The tree conv with its dt programs at the Mamba2-2.7B channel count, every channel tile, NaN-poisoned."""
    from stree.kernels.compare import rel_err
    from stree.kernels.tree_conv import tree_conv_dt_ref
    from stree.kernels.tree_conv_triton import tree_conv1d_triton

    g = torch.Generator(device="cuda").manual_seed(n)
    c, h = 80 * 64 + 2 * 128, 80
    parents = torch.cat([torch.tensor([-1]), torch.randint(0, 10**9, (n - 1,)) % torch.arange(1, n)])[None].cuda()
    rnd = lambda *size, scale=1.0: (torch.randn(*size, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    xbc, state, w, bias = rnd(1, n, c), rnd(1, c, 3), rnd(c, 4, scale=0.5), rnd(c)
    dt_raw, dt_bias = rnd(1, n, h), rnd(h)
    want, want_dt = tree_conv_dt_ref(xbc, state, w, bias, parents, dt_raw, dt_bias, (0.0, float("inf")))
    out, dt, pre = torch.full_like(xbc, float("nan")), torch.full((1, n, h), float("nan"), device="cuda"), \
        torch.full_like(xbc, float("nan"))
    tree_conv1d_triton(xbc, state, w, bias, parents, out=out, dt=(dt_raw, dt_bias, (0.0, float("inf")), dt), pre=pre,
                       block_c=block_c)
    assert rel_err(out, want) < tol and rel_err(dt, want_dt) < 1e-5 and torch.equal(pre, xbc)


@pytest.mark.parametrize("width", [768, 2560, 5120])
def test_norms_at_every_warp_count_match_reference(width):
    """Both row norms in bf16 at the warp counts ``row_warps`` picks among, NaN-free and close to the references."""
    from stree.kernels.compare import rel_err
    from stree.kernels.norms import add_rmsnorm_ref, gated_rmsnorm_ref
    from stree.kernels.norms_triton import add_rmsnorm_triton, gated_rmsnorm_triton

    g = torch.Generator(device="cuda").manual_seed(width)
    rnd = lambda *size: torch.randn(*size, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    y, z, x, w = rnd(32, width), rnd(32, 2 * width)[:, :width], rnd(32, width), rnd(width)
    r = torch.randn(32, width, device="cuda", generator=g)
    for warps in (None, 4, 8, 16):
        got = gated_rmsnorm_triton(y, z, w, width, 1e-5, num_warps=warps)
        assert rel_err(got, gated_rmsnorm_ref(y, z, w, width, 1e-5)) < 2e-2
        got, res = add_rmsnorm_triton(x, r, w, 1e-5, True, num_warps=warps)
        want, want_res = add_rmsnorm_ref(x, r, w, 1e-5, True)
        assert rel_err(got, want) < 2e-2 and torch.equal(res, want_res)
