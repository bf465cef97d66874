"""TreeFlash: greedy output equals plain greedy, sampled output has the target's law, q rows are exact.

Tiny random targets and random TreeFlash networks (sharpened so their drafts are far from
uniform); the engine hands the drafter the target's hidden state at the last accepted node.
"""

from __future__ import annotations

import pytest
import torch

import stree
from stree.drafter_service.drafters.treeflash.device_draft import TreeFlashDeviceDrafter
from stree.protocols import SamplingParams, create_drafter
from stree.protocols.device_drafter import DeviceDrafter
from stree.protocols.sampling import RowSampling, warp_logits
from stree.protocols.tree_shape import TreeShape
from stree.verifier.decode.engine import Engine, Request
from stree.verifier.model.checkpoint import init_model, load_model
from stree.verifier.model.treeflash import TreeFlashConfig, TreeFlashNet, load_treeflash, save_treeflash

from stat_helpers import chisquare_pvalue, exact_sequence_distribution

ALPHA = 1e-3
VOCAB = 6
PROMPT = [1, 4, 2]


def _net(d_target: int, vocab: int, sharpen: float = 1.0, seed: int = 0) -> TreeFlashNet:
    torch.manual_seed(seed)
    net = TreeFlashNet(TreeFlashConfig(d_target=d_target, vocab_size=vocab, d_model=16, depth=3, n_layer=1))
    with torch.no_grad():
        net.norm_f.weight.mul_(sharpen)
    return net.eval()


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf_pair")
    target = load_model(init_model(root / "t", arch="hybrid", n_layer=2, attn_layers=[1], seed=21, d_model=16,
                                   d_state=8, headdim=8, vocab_size=VOCAB))
    with torch.no_grad():
        target.backbone.norm_f.weight.mul_(12.0)
    return target, _net(16, VOCAB, sharpen=8.0, seed=5)


def _plain(model, prompts, n):
    return [r.token_ids for r in stree.generate(model, prompts, drafter=None, max_new_tokens=n, cuda_graphs=False)]


@pytest.mark.parametrize("name", ["treeflash", "treeflash-marginal"])
@pytest.mark.parametrize("tree", ["static:2,2,1", "chain:3"])
def test_greedy_equals_plain_greedy(models, small_pair, name, tree):
    for target, net in [(models["hybrid"], _net(32, 64, sharpen=4.0)), small_pair]:
        gen = torch.Generator().manual_seed(len(tree))
        prompts = [torch.randint(0, target.vocab_size, (k,), generator=gen).tolist() for k in (1, 5, 9)]
        outs = stree.generate(target, prompts, drafter=name, treeflash=net, tree=tree, max_new_tokens=12,
                              cuda_graphs=False)
        assert [o.token_ids for o in outs] == _plain(target, prompts, 12)


def test_engine_hands_the_target_hidden_state_of_the_last_accepted_node(small_pair):
    target, net = small_pair
    drafter = TreeFlashDeviceDrafter(net)
    assert isinstance(drafter, DeviceDrafter)
    engine = Engine(target, drafter, ["none", "static:2,1"], max_batch=2, max_seqlen=64, goodput=True)
    seen = []  # (slot, sequence so far, the drafter's hidden state) after every step that did not finish

    def snapshot(req, _tokens):
        if not req.done:
            seen.append((engine.slots.index(req), req.prompt_ids + req.output, drafter.hidden.clone()))

    engine.run([Request([3, 1, 4, 1, 5], max_new_tokens=9, on_tokens=snapshot),
                Request([2], max_new_tokens=7, on_tokens=snapshot)])
    assert len(seen) >= 4
    for slot, seq, held in seen:
        _, hidden = target(torch.tensor([seq[:-1]]), return_hidden=True)  # the state that chose the last token
        torch.testing.assert_close(held[slot], hidden[0, -1], atol=1e-4, rtol=1e-4)


def _exact_law(target, params):
    def next_probs(ctx):
        return warp_logits(target.score_sequence(torch.tensor(ctx))[-1], params).double()

    return exact_sequence_distribution(next_probs, PROMPT, 2)


@pytest.mark.parametrize("name, params", [
    ("treeflash", SamplingParams(temperature=1.0)),
    ("treeflash-marginal", SamplingParams(temperature=0.8, top_k=4)),
    ("treeflash", SamplingParams(temperature=1.2, top_p=0.9)),
], ids=["cond-t1", "marginal-topk", "cond-topp"])
def test_sampled_output_has_the_target_distribution(small_pair, name, params):
    target, net = small_pair
    outs = stree.generate(target, [PROMPT] * 1200, drafter=name, treeflash=net, tree="static:3,2", max_new_tokens=2,
                          temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=77,
                          max_batch=64, cuda_graphs=False)
    p = chisquare_pvalue([tuple(o.token_ids) for o in outs], _exact_law(target, params))
    assert p > ALPHA, f"{name}: sampled sequences do not follow the target's law (p={p:.2e})"


def _drafts(net, conditional, temperature, batch=3000, shape="static:3,2,1"):
    """``batch`` drafts from one fixed hidden state and root; returns (drafter, draft, block states)."""
    drafter = TreeFlashDeviceDrafter(net, conditional)
    drafter.new_slots(batch, 16)
    drafter.observe_target(torch.randn(net.config.d_target).expand(batch, -1))
    sampling = RowSampling.greedy(batch, "cpu")
    sampling.temperature.fill_(temperature)
    sampling.seed.copy_(torch.arange(batch) * 104729 + 3)  # each row a request of its own seed: independent draws
    roots = torch.full((batch,), 2, dtype=torch.long)
    draft = drafter.draft(TreeShape.parse(shape), roots, sampling, temperature > 0)
    return drafter, draft, net.depth_states(drafter.hidden, roots)


@pytest.mark.parametrize("conditional", [True, False])
def test_q_rows_are_the_warped_head_and_sum_to_one(conditional):
    net = _net(8, 12, sharpen=3.0, seed=9)
    _, draft, states = _drafts(net, conditional, temperature=0.9, batch=4)
    shape = TreeShape.parse("static:3,2,1")
    depths = shape.depths()
    for i in range(shape.num_nodes - shape.level_sizes[-1]):  # every node with children
        d = depths[i]
        if conditional:
            logits = net.conditional_logits(states[:, d], draft.tokens[:, i])
        else:
            logits = net.marginal_logits(states[:, d])
        torch.testing.assert_close(draft.q[:, i], torch.softmax(logits / 0.9, -1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(draft.q[:, i].sum(-1), torch.ones(4))
        kids = [j for j, p in enumerate(shape.static_parents()) if p == i]
        assert len(set(draft.tokens[0, kids].tolist())) == len(kids)  # drawn without replacement


@pytest.mark.parametrize("conditional", [True, False])
def test_children_are_draws_from_q(conditional):
    """The first child of a node is one draw from its q row; the second, a draw from q without the first."""
    net = _net(8, 5, sharpen=2.0, seed=4)
    _, draft, _ = _drafts(net, conditional, temperature=1.0)
    q = draft.q[0, 0].double()
    assert chisquare_pvalue(draft.tokens[:, 1].tolist(), dict(enumerate(q.tolist()))) > ALPHA
    law = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(5) for b in range(5) if a != b}
    assert chisquare_pvalue(list(zip(draft.tokens[:, 1].tolist(), draft.tokens[:, 2].tolist())), law) > ALPHA


def test_greedy_children_are_the_top_tokens_and_marginal_siblings_agree():
    net = _net(8, 12, sharpen=3.0, seed=2)
    for conditional in (True, False):
        _, draft, states = _drafts(net, conditional, temperature=0.0, batch=2)
        assert draft.q is None  # greedy: no warped law is computed (the engine verifies by argmax)
        top = net.marginal_logits(states[:, 0]).topk(3).indices if not conditional else \
            net.conditional_logits(states[:, 0], draft.tokens[:, 0]).topk(3).indices
        assert torch.equal(draft.tokens[:, 1:4], top)
    # the marginal ablation: every parent at depth 1 gets the same two children
    assert torch.equal(draft.tokens[:, 4:6], draft.tokens[:, 6:8])


def test_checkpoint_round_trip_and_bad_options(tmp_path):
    net = _net(8, 12, seed=1)
    loaded = load_treeflash(save_treeflash(net, tmp_path / "tf"))
    for a, b in zip(net.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    drafter = create_drafter("treeflash", treeflash=str(tmp_path / "tf"), tree="chain:2")
    assert drafter.device_drafter().shapes == [TreeShape.parse("chain:2")]
    with pytest.raises(ValueError, match="depth"):
        create_drafter("treeflash-marginal", treeflash=net, tree="chain:4")
    with pytest.raises(ValueError, match="treeflash="):
        create_drafter("treeflash")
    with pytest.raises(ValueError, match="not a TreeFlash checkpoint"):
        load_treeflash(tmp_path / "missing")
    with pytest.raises(ValueError, match="d_model"):
        TreeFlashConfig(d_target=8, vocab_size=12, d_model=0)
