"""Greedy speculative output equals plain greedy decoding token for token, for every drafter."""

from __future__ import annotations

import pytest
import torch

import stree
from stree import DraftBudget, TokenTree
from stree.protocols.drafter import ContextSession, HostDrafter

ARCHS = ["mamba2", "hybrid"]
MODEL_DRAFTERS = [
    ("chain", {}),
    ("static-tree", {}),
    ("static-tree", {"tree_widths": "3,2,2,1"}),
    ("mamba", {"tree": "beam:4x3"}),
    ("mamba", {"tree": "dynamic:16"}),
]


def _prompts(n: int, vocab: int):
    g = torch.Generator().manual_seed(42)
    return [torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter, options", MODEL_DRAFTERS)
def test_model_drafters_match_plain_greedy(models, arch, drafter, options):
    target = models[arch]
    for i, prompt in enumerate(_prompts(4, target.vocab_size)):
        n = [1, 7, 19, 33][i]
        plain = stree.generate(target, prompt, max_new_tokens=n).token_ids
        for draft in (models["draft"], models["mamba2"]):  # a weak draft, and a strong one (high acceptance)
            got = stree.generate(target, prompt, drafter=drafter, draft_model=draft, max_new_tokens=n, **options)
            assert got.token_ids == plain, (drafter, options, prompt)
            assert len(got.token_ids) == n


@pytest.mark.parametrize("arch", ARCHS)
def test_self_drafting_accepts_whole_chains(models, arch):
    """With the target as its own draft model every drafted token is accepted."""
    target = models[arch]
    got = stree.generate(target, [1, 2, 3], drafter="chain", draft_model=target, max_new_tokens=25,
                         num_speculative_tokens=4)
    assert got.stats["mean_accepted_length"] == pytest.approx(5.0, abs=0.5)  # last step may be cut short
    assert got.token_ids == stree.generate(target, [1, 2, 3], max_new_tokens=25).token_ids


class _BadDrafter(HostDrafter):
    """A drafter that misbehaves in a chosen way on every other step."""

    name = "bad"

    def __init__(self, how: str):
        self.how = how

    def open(self, prompt_ids, params):
        drafter = self

        class Session(ContextSession):
            calls = 0

            def draft(self, budget):
                Session.calls += 1
                root = self.context[-1]
                if Session.calls % 2:
                    return TokenTree.from_parents([root, 1, 2], [-1, 0, 0])
                if drafter.how == "raise":
                    raise RuntimeError("boom")
                if drafter.how == "wrong-root":
                    return TokenTree.from_parents([(root + 1) % 64, 1], [-1, 0])
                if drafter.how == "over-budget":
                    return TokenTree.chain([root] + [1] * (budget.max_nodes + 3))
                if drafter.how == "bad-vocab":
                    return TokenTree.from_parents([root, 10_000], [-1, 0])
                return "not a tree"

        return Session(prompt_ids, params)


@pytest.mark.parametrize("how", ["raise", "wrong-root", "over-budget", "bad-vocab", "not-a-tree"])
def test_misbehaving_drafter_never_changes_output(models, how):
    target = models["hybrid"]
    plain = stree.generate(target, [5, 6, 7], max_new_tokens=12).token_ids
    got = stree.generate(target, [5, 6, 7], drafter=_BadDrafter(how), max_new_tokens=12,
                         budget=DraftBudget(max_nodes=8, max_depth=4, max_width=4))
    assert got.token_ids == plain
    assert got.stats["drafter_fallbacks"] >= 1


def test_unknown_drafter_and_vocab_mismatch_are_clear_errors(models, tmp_path):
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        stree.generate(models["mamba2"], [1, 2], drafter="nope")
    with pytest.raises(ValueError, match="needs a draft model"):
        stree.generate(models["mamba2"], [1, 2], drafter="chain")
    small = stree.load_model(stree.verifier.model.checkpoint.init_model(tmp_path / "v", vocab_size=32, d_model=16,
                                                                  n_layer=1, d_state=8, headdim=8))
    with pytest.raises(ValueError, match="draft model vocabulary"):
        stree.generate(models["mamba2"], [1, 2], drafter="chain", draft_model=small)
    with pytest.raises(ValueError, match="at least one token"):
        stree.generate(models["mamba2"], [])
    with pytest.raises(ValueError, match="temperature"):
        stree.generate(models["mamba2"], [1], temperature=-1.0)


def test_stop_tokens_end_generation(models):
    target = models["mamba2"]
    plain = stree.generate(target, [3, 4], max_new_tokens=20).token_ids
    stop = plain[5]
    first = plain.index(stop)
    got = stree.generate(target, [3, 4], drafter="chain", draft_model=target, max_new_tokens=20,
                         stop_token_ids=[stop])
    assert got.token_ids == plain[: first + 1]


def test_vocab_trimmed_drafter_keeps_output_and_restricts_drafts(models):
    from stree.drafter_service.drafters.mamba.drafter import MambaDrafter, frequent_tokens

    target, draft = models["hybrid"], models["mamba2"]
    keep = frequent_tokens([list(range(0, 64, 2)) * 3, [1, 3, 5]], 20)
    assert len(keep) == 20
    drafter = MambaDrafter(draft, "static:3,2", vocab_keep=keep)
    prompt = [2, 4, 6, 8]
    assert stree.generate(target, prompt, drafter=drafter, max_new_tokens=20).token_ids == \
        stree.generate(target, prompt, max_new_tokens=20).token_ids
    session = drafter.open(prompt, stree.SamplingParams())
    tree = session.draft(DraftBudget(max_nodes=16, max_depth=4, max_width=4))
    assert set(tree.tokens[1:].tolist()) <= set(keep.tolist())
    state = draft.new_state(1, 8)
    full = draft.step(torch.tensor([3]), state.clone())
    part = draft.step(torch.tensor([3]), state.clone(), drafter.head)
    torch.testing.assert_close(part[0, keep], full[0, keep])
    assert torch.isinf(part[0]).sum() == draft.vocab_size - 20
