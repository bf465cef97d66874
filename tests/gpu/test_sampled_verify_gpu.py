"""The sampled verification kernel on the GPU: agreement with the reference on fresh random inputs (fp32 and bf16
logits, the demo pair's and the 2.7B's vocabularies; top-k / top-p rows through filtered logits too), the target's
law (chi-square) in every draft mode, filtered or not, with a biased kernel caught by the same test, and a CUDA
graph replay equal to eager."""

from __future__ import annotations

import pytest
import torch
from kernel_trees import verify_case
from stat_helpers import assert_same_distribution, chisquare_pvalue
from stree.kernels.cuda_graph import capture_graph
from stree.kernels.sampled_verify import sampled_verify_ref
from stree.kernels.sampled_verify_triton import sampled_verify_triton
from stree.protocols.token_tree import DraftMode
from verify_toys import ALPHA, PARAMS, WOR_P, ToyBatch, wor_first_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MODES = list(DraftMode)


def _cuda(args):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]


def _on_gpu(**bias):
    """The kernel as a ``verify`` function of CPU tensors (the toys build their trees on the CPU)."""
    return lambda *args: [t.cpu() for t in sampled_verify_triton(*_cuda(args), **bias)]


def _filtered_on_gpu(**bias):
    """The kernel on logits filtered to each row's top-k / top-p set (what ``ops.sampled_verify`` hands it)."""
    from stree.protocols.sampling import filter_logits_rows

    def verify(*args):
        a = _cuda(args)
        a[3] = filter_logits_rows(a[3], a[4], a[5], a[6])
        return [t.cpu() for t in sampled_verify_triton(*a[:5], None, None, *a[7:], **bias)]

    return verify


def _same_rows(got, want) -> torch.Tensor:
    return (got[0] == want[0]).all(1) & (got[1] == want[1]) & (got[2] == want[2]) & (got[3] == want[3]).all(1)


@pytest.mark.parametrize("vocab, dtype", [(8192, torch.float32), (50280, torch.bfloat16), (37, torch.float32)])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_sampled_kernel_agrees_with_reference(mode, vocab, dtype):
    rows = same = deep = 0
    for seed in range(30):
        args = _cuda(verify_case(seed, mode, vocab, follow=0.8, dtype=dtype))
        for t in sampled_verify_triton(*args):  # NaN-poisoned check: every output written
            assert not torch.isnan(t.float()).any()
        got, want = sampled_verify_triton(*args), sampled_verify_ref(*args)
        ok = _same_rows(got, want)
        rows, same, deep = rows + ok.numel(), same + int(ok.sum()), deep + int((want[1] > 1).sum())
    assert same >= 0.98 * rows, f"kernel agreed with the reference on {same} of {rows} rows"
    assert deep > 10


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_sampled_kernel_law_matches_target(mode):
    toy = ToyBatch(PARAMS["t1.4"], mode)
    samples, num_out = toy.first_two(verify=_on_gpu())
    assert int(num_out.max()) >= 3, "trees should sometimes accept two drafted tokens"
    assert_same_distribution(samples, toy.exact_law(), ALPHA)


@pytest.mark.parametrize("vocab, dtype", [(8192, torch.float32), (50280, torch.bfloat16)])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_filtered_rows_through_ops_agree_with_reference(mode, vocab, dtype):
    """Top-k / top-p rows on the GPU: ``ops.sampled_verify`` (filtered logits, then the kernel) against the
    reference walking the filters itself, same uniforms."""
    from stree.kernels import ops

    rows = same = 0
    for seed in range(20):
        args = _cuda(verify_case(seed, mode, vocab, follow=0.8, dtype=dtype))
        g = torch.Generator().manual_seed(seed)
        b = args[0].shape[0]
        args[5] = (torch.randint(1, 200, (b,), generator=g) * (torch.rand(b, generator=g) < 0.6)).cuda()
        args[6] = torch.where(torch.rand(b, generator=g) < 0.6, 0.3 + 0.6 * torch.rand(b, generator=g), 1.0).cuda()
        got, want = ops.sampled_verify(*args), sampled_verify_ref(*args)
        ok = _same_rows(got, want)
        rows, same = rows + ok.numel(), same + int(ok.sum())
    assert same >= 0.98 * rows, f"kernel agreed with the reference on {same} of {rows} rows"


@pytest.mark.parametrize("params", ["t0.7-topk3", "t1.4-topp0.8"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_filtered_kernel_law_matches_target_and_a_bias_is_caught(mode, params):
    toy = ToyBatch(PARAMS[params], mode)
    samples, _ = toy.first_two(verify=_filtered_on_gpu())
    assert_same_distribution(samples, toy.exact_law(), ALPHA)
    biased, _ = toy.first_two(verify=_filtered_on_gpu(accept_scale=1.5))
    assert chisquare_pvalue(biased, toy.exact_law()) < ALPHA


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_biased_sampled_kernel_is_detected(mode):
    """Accepting when u * q < 1.5 p (too often) must fail the same chi-square test."""
    toy = ToyBatch(PARAMS["t1.4"], mode)
    samples, _ = toy.first_two(verify=_on_gpu(accept_scale=1.5))
    assert chisquare_pvalue(samples, toy.exact_law()) < ALPHA


def test_sampled_kernel_without_replacement_is_exact_and_needs_its_rule():
    assert_same_distribution(wor_first_tokens(verify=_on_gpu()), dict(enumerate(WOR_P)), ALPHA)
    assert chisquare_pvalue(wor_first_tokens(verify=_on_gpu(remove=False)), dict(enumerate(WOR_P))) < ALPHA


def test_sampled_kernel_graph_replay_equals_eager():
    """One capture, then fresh logits, draft laws and uniforms copied into its inputs: replay equals eager."""
    static = _cuda(verify_case(3, DraftMode.IID, 512))
    graph, out = capture_graph(lambda: sampled_verify_triton(*static))
    for k in range(5):
        fresh = list(static)
        for i in (3, 8, 9, 10):  # logits, draft_probs, uniforms, bonus uniforms
            fresh[i] = torch.rand_like(static[i]) * (4.0 if i == 3 else 1.0)
            static[i].copy_(fresh[i])
        graph.replay()
        for g, e in zip(out, sampled_verify_triton(*fresh)):
            assert torch.equal(g, e), k


@pytest.mark.parametrize("drafter, options", [(None, {}), ("mamba", {"tree": "chain:3"}),
                                              ("static-tree", {"tree_widths": "3,2"})],
                         ids=["plain", "chain-point-mass", "static-without-replacement"])
def test_graphed_engine_samples_the_target_law(tmp_path, drafter, options):
    """The engine's sampled steps on the GPU (CUDA graphs, this kernel): the first two tokens of 1200 generations
    of one prompt follow the target's exact law at T=1, as the CPU reference's do (tests/verifier/test_sampling_e2e)."""
    from stat_helpers import exact_sequence_distribution
    from stree.protocols.sampling import SamplingParams, warp_logits
    from stree.verifier.decode.loop import generate
    from stree.verifier.model.checkpoint import init_model, load_model

    small = dict(d_model=64, d_state=16, headdim=16, vocab_size=6)  # tl.dot needs dims of 16 or more
    target = load_model(init_model(tmp_path / "t", arch="hybrid", n_layer=2, attn_layers=[1], seed=11, **small),
                        device="cuda")
    draft = load_model(init_model(tmp_path / "d", arch="mamba2", n_layer=1, seed=12, **small), device="cuda")
    with torch.no_grad():
        target.backbone.norm_f.weight.mul_(12.0)
        draft.backbone.norm_f.weight.mul_(9.0)
    prompt, params = [1, 4, 2], SamplingParams(temperature=1.0)
    outs = generate(target, [prompt] * 1200, drafter=drafter, draft_model=draft if drafter else None,
                    max_new_tokens=2, temperature=1.0, seed=1000, max_batch=64, **options)
    law = exact_sequence_distribution(
        lambda ctx: warp_logits(target.score_sequence(torch.tensor(ctx, device="cuda"))[-1], params).double().cpu(),
        prompt, 2)
    assert_same_distribution([tuple(o.token_ids) for o in outs], law, ALPHA)


def test_keyed_uniforms_on_the_gpu_equal_the_cpu_reference_bits():
    """The Triton keyed-uniform kernel on CUDA, and the reference run on CUDA, give the CPU reference's bits (int64
    wrap-around, 32-bit masks, the keys derived in the kernel), also inside a captured CUDA graph."""
    from stree.kernels.keyed_random import DRAFT_LANE, keyed_uniform_ref
    from stree.kernels.keyed_random_triton import keyed_uniform_triton

    seed = torch.tensor([0, -1, 2**62 + 5, 7, 123456789])
    step = torch.tensor([0, 3, 9, 2**40, 77])
    n = 50280 * 3
    want = keyed_uniform_ref(seed, step, DRAFT_LANE + 2, n)
    seed_d, step_d = seed.cuda(), step.cuda()
    assert torch.equal(keyed_uniform_ref(seed_d, step_d, DRAFT_LANE + 2, n).cpu(), want)
    assert torch.equal(keyed_uniform_triton(seed_d, step_d, DRAFT_LANE + 2, n).cpu(), want)
    keyed_uniform_triton(seed_d, step_d, DRAFT_LANE + 2, n)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = keyed_uniform_triton(seed_d, step_d, DRAFT_LANE + 2, n)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
