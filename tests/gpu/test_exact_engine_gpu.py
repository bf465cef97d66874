"""GPU, bf16 and fp16, exact numerics (the default): speculative greedy output equals plain greedy output token for
token for every drafter and tree (chain, static, beam, dynamic, TreeFlash, n-gram) at batch 1, 3, 8 and 64, on pure
Mamba2 and hybrid targets with random weights and no sharpening (near-ties everywhere), on a random Mamba2-2.7B-
shape model (a few layers, and once all 64), and on one tiny model of every Hugging Face family; plain greedy output
itself does not depend on the batch, and a request alone equals the same request inside a batch of 64 others (at
T > 0 too, with a seed per request)."""

from __future__ import annotations

import pytest
import torch

import stree
from stree.bench.numerics import SHAPES, build_model
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.treeflash import TreeFlashConfig, TreeFlashNet
from hf_helpers import FAMILIES, tiny_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]  # every dtype exact numerics covers
BATCHES = (1, 3, 8, 64)
GRAPHED = ("beam:4x3", "chain:4")  # these run as CUDA-graph replays (the rest eagerly: the same kernels)


def random_prompts(n: int, vocab: int, seed: int) -> list:
    """``n`` prompts of 1-60 tokens; every other one repeats a short motif, so n-gram lookup finds drafts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        length = int(torch.randint(1, 61, (1,), generator=gen))
        if k % 2:
            motif = torch.randint(0, vocab, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen)
            out.append(motif.repeat(length // motif.numel() + 1)[:length].tolist())
        else:
            out.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    return out


def treeflash_net(d_target: int, vocab: int, device, dtype) -> TreeFlashNet:
    torch.manual_seed(5)
    net = TreeFlashNet(TreeFlashConfig(d_target=d_target, vocab_size=vocab, d_model=64, depth=3, n_layer=1))
    return net.to(device=device, dtype=dtype).eval()


def drafters(draft, net=None) -> list:
    """``(name, options)`` of every drafter and tree kind: device chains, static trees, beams, dynamic trees,
    TreeFlash (given a network), and n-gram lookup (a host drafter: trees padded into node buckets)."""
    out = [("mamba", dict(draft_model=draft, tree=t)) for t in ("chain:4", "static:3,2,1", "beam:4x3", "dynamic:12")]
    if net is not None:
        out.append(("treeflash", dict(treeflash=net, tree="static:3,2,1")))
    return out + [("ngram", {})]


def greedy(target, prompts, n_new: int, batch: int, drafter=None, graphs: bool = False, **opts) -> list:
    return [r.token_ids for r in stree.generate(target, prompts, drafter=drafter, max_new_tokens=n_new,
                                                max_batch=batch, cuda_graphs=graphs, **opts)]


def mismatches(target, specs, prompts, n_new: int, batches=BATCHES) -> list:
    """``(drafter, tree, batch)`` whose greedy output differs from plain greedy at batch 64 (plain decoding at every
    batch size is checked too, as ``("plain", None, batch)``)."""
    want = greedy(target, prompts, n_new, 64, graphs=True)
    bad = [("plain", None, b) for b in batches if greedy(target, prompts[:b], n_new, b, graphs=True) != want[:b]]
    for name, opts in specs:
        for b in batches:
            got = greedy(target, prompts[:b], n_new, b, name, graphs=opts.get("tree") in GRAPHED, **opts)
            if got != want[:b]:
                bad.append((name, opts.get("tree"), b))
    return bad


@pytest.fixture(scope="module")
def tiny(gpu_models):
    """The tiny checkpoints of ``conftest.py`` (random weights, no sharpening) in each dtype."""
    return {(name, dtype): load_model(path, device="cuda", dtype=dtype) for name, path in gpu_models.items()
            for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_every_drafter_equals_plain_greedy_at_every_batch(tiny, arch, dtype):
    target, draft = tiny[(arch, dtype)], tiny[("draft", dtype)]
    net = treeflash_net(target.config.d_model, target.vocab_size, "cuda", dtype)
    prompts = random_prompts(64, target.vocab_size, seed=7)
    assert mismatches(target, drafters(draft, net), prompts, n_new=24) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_request_alone_equals_the_same_request_among_64_others(tiny, dtype):
    target, draft = tiny[("hybrid", dtype)], tiny[("draft", dtype)]
    mine = random_prompts(1, target.vocab_size, seed=11)[0]
    others = random_prompts(63, target.vocab_size, seed=12)
    for name, opts in ((None, {}), ("mamba", dict(draft_model=draft, tree="beam:4x3"))):
        alone = greedy(target, [mine], 32, 1, name, graphs=True, **opts)[0]
        assert greedy(target, others[:20] + [mine] + others[20:], 32, 64, name, graphs=True, **opts)[20] == alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_seeded_sampled_request_alone_equals_it_among_64_others(tiny, dtype):
    """T > 0 with a seed per request (draws keyed by seed and step, ``kernels.keyed_random``): the same tokens alone
    and 21st in a batch of 64, plain and with a fixed beam tree, through the CUDA graphs."""
    target, draft = tiny[("hybrid", dtype)], tiny[("draft", dtype)]
    mine = random_prompts(1, target.vocab_size, seed=13)[0]
    others = random_prompts(63, target.vocab_size, seed=14)
    seeds = list(range(1000, 1020)) + [123] + list(range(2000, 2043))
    sampled = dict(max_new_tokens=32, temperature=0.9, top_p=0.95, cuda_graphs=True)
    for name, opts in ((None, {}), ("mamba", dict(draft_model=draft, tree="beam:4x3"))):
        alone = stree.generate(target, [mine], drafter=name, max_batch=1, seed=[123], **sampled, **opts)[0]
        batch = stree.generate(target, others[:20] + [mine] + others[20:], drafter=name, max_batch=64, seed=seeds,
                               **sampled, **opts)
        assert batch[20].token_ids == alone.token_ids, name


@pytest.fixture(scope="module")
def shape_2p7b():
    """A random Mamba2-2.7B-shape target with 4 layers and a 2-layer 130M-shape draft (bf16, mamba_ssm's vocab)."""
    target = build_model(SHAPES["2.7b"], 4, 50280, "cuda", torch.bfloat16)
    draft = build_model(SHAPES["130m"], 2, 50280, "cuda", torch.bfloat16)
    return target, draft


def test_2p7b_shape_every_drafter_equals_plain_greedy_at_every_batch(shape_2p7b):
    target, draft = shape_2p7b
    prompts = random_prompts(64, target.vocab_size, seed=21)
    assert mismatches(target, drafters(draft), prompts, n_new=16) == []


def test_full_64_layer_2p7b_shape_beam_and_chain_equal_plain_greedy():
    target = build_model(SHAPES["2.7b"], 64, 50280, "cuda", torch.bfloat16)
    draft = build_model(SHAPES["130m"], 2, 50280, "cuda", torch.bfloat16)
    prompts = random_prompts(8, target.vocab_size, seed=31)
    specs = [("mamba", dict(draft_model=draft, tree=t)) for t in ("beam:4x3", "chain:4")]
    assert mismatches(target, specs, prompts, n_new=16, batches=(1, 8)) == []
    del target, draft
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_family_drafts_equal_plain_greedy(name, dtype, tmp_path):
    pytest.importorskip("transformers")
    dirs = tiny_pair(name, tmp_path)
    target = load_model(dirs["target"], device="cuda", dtype=dtype)
    draft = load_model(dirs["draft"], device="cuda", dtype=dtype)
    prompts = random_prompts(3, target.vocab_size, seed=41)
    specs = [("mamba", dict(draft_model=draft, tree=t)) for t in ("chain:4", "static:2,2,1", "beam:3x2")]
    assert mismatches(target, specs + [("ngram", {})], prompts, n_new=16, batches=(1, 3)) == []
