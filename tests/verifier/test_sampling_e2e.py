"""Sampled speculative output has the target's distribution (chi-square, alpha = 1e-3 per test).

A tiny-vocabulary hybrid target with sharpened logits and a different Mamba2 draft model; the
empirical law of the first two generated tokens is compared with the exact law computed from the
target alone. The same check applied to a verifier biased on purpose must reject it.
"""

from __future__ import annotations

import pytest
import torch

import stree
from stree import DraftMode, SamplingParams, TokenTree
from stree.protocols.drafter import ContextSession, HostDrafter
from stree.protocols.sampling import warp_logits
from stree.protocols.sampling import sample_inverse_cdf, warp_logits_rows
from stree.verifier.decode import step_program as engine_mod

from sampling_pair import VOCAB, sharpened_pair
from stat_helpers import chisquare_pvalue, exact_sequence_distribution

ALPHA = 1e-3  # false-alarm rate of each distribution test
SAMPLES = 1200
PROMPT = [1, 4, 2]
LOOKUP_PROMPT = [1, 4, 2, 5, 1, 4, 3, 5, 1, 4]  # "1 4" was followed by "2 5" and by "3 5": lookup drafts branch


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return sharpened_pair(tmp_path_factory.mktemp("tiny_vocab"))


class IIDDrafter(HostDrafter):
    """Children drawn i.i.d. from the draft model's warped distribution (two levels)."""

    name = "iid-test"

    def __init__(self, draft, width=3):
        self.draft, self.width = draft, width

    def open(self, prompt_ids, params):
        outer = self

        class Session(ContextSession):
            gen = torch.Generator().manual_seed(params.seed)  # each session's own seed: fresh draws from q

            def _q(self, ids):
                return warp_logits(outer.draft.score_sequence(torch.tensor(ids))[-1], params)

            def draft(self, budget):
                ctx = self.context
                q0 = self._q(ctx)
                kids = torch.multinomial(q0, outer.width, replacement=True, generator=self.gen).tolist()
                tokens, parents, rows = [ctx[-1]] + kids, [-1] + [0] * len(kids), [q0] + [None] * len(kids)
                q1 = self._q(ctx + [kids[0]])
                for t in torch.multinomial(q1, 2, replacement=True, generator=self.gen).tolist():
                    tokens.append(t)
                    parents.append(1)
                    rows.append(None)
                rows[1] = q1
                probs = torch.stack([r if r is not None else torch.zeros(VOCAB) for r in rows])
                return TokenTree(tokens, parents, draft_probs=probs, mode=DraftMode.IID)

        return Session(prompt_ids, params)


def _exact_law(target, params, prompt=PROMPT):
    def next_probs(ctx):
        return warp_logits(target.score_sequence(torch.tensor(ctx))[-1], params).double()

    return exact_sequence_distribution(next_probs, prompt, 2)


def _pvalue(target, draft, drafter, params: SamplingParams, options=None, prompt=PROMPT) -> float:
    """SAMPLES independent generations of the same prompt, batched 64 at a time by the engine."""
    outs = stree.generate(target, [prompt] * SAMPLES, drafter=drafter, draft_model=draft, max_new_tokens=2,
                          temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          seed=1000, max_batch=64, **(options or {}))
    samples = [tuple(out.token_ids) for out in outs]
    return chisquare_pvalue(samples, _exact_law(target, params, prompt))


CASES = [
    # (drafter, options, params) — modes: WOR (static/chain), IID (test drafter), deterministic (beam)
    ("static-tree", {"tree_widths": "3,2"}, SamplingParams(temperature=1.0)),
    ("chain", {"num_speculative_tokens": 3}, SamplingParams(temperature=0.7, top_k=4)),
    ("iid", {}, SamplingParams(temperature=1.3, top_p=0.9)),
    ("mamba", {"tree": "beam:3x2"}, SamplingParams(temperature=1.0, top_k=5, top_p=0.95)),
]


@pytest.mark.parametrize("drafter, options, params", CASES, ids=["wor-static", "wor-chain-topk", "iid-topp", "det-beam"])
def test_speculative_sampling_matches_target_distribution(pair, drafter, options, params):
    target, draft = pair
    d = IIDDrafter(draft) if drafter == "iid" else drafter
    p = _pvalue(target, draft, d, params, options)
    assert p > ALPHA, f"sampled sequences do not follow the target's law (p={p:.2e})"


class HostOnly(HostDrafter):
    """A built-in drafter's host sessions only (its device drafter hidden): the path a remote drafter's trees take.
    Each session draws on the seed the caller gave it; one seed for every request would make every request's
    drafts one draw, which this test catches."""

    name = "host-only"

    def __init__(self, inner):
        self.inner = inner

    def open(self, prompt_ids, params):
        return self.inner.open(prompt_ids, params)


def test_host_sessions_of_a_stochastic_drafter_keep_the_target_distribution(pair):
    from stree.protocols.registry import create_drafter

    target, draft = pair
    host = HostOnly(create_drafter("static-tree", draft_model=draft, tree_widths=[3, 2]))
    p = _pvalue(target, draft, host, SamplingParams(temperature=1.0))
    assert p > ALPHA, f"host-drafted sampled sequences do not follow the target's law (p={p:.2e})"


def test_session_seeds_are_per_request_and_reproducible():
    from stree.protocols.drafter import session_seeds

    seeds = session_seeds(7, 1000)
    assert len(set(seeds)) == 1000 and seeds == session_seeds(7, 1000) and seeds != session_seeds(8, 1000)
    assert session_seeds(None, 2) != session_seeds(None, 2)


LOOKUP_CASES = [
    # point-mass drafts of the device n-gram drafter, and a model beam fused with them (retrieval drafts the same
    # kind of tree: tests/drafters/test_lookup_device.py)
    ("ngram", {"lookup_tree": "trie:2x2"}, SamplingParams(temperature=0.9, top_k=5, top_p=0.95)),
    ("fusion:mamba+ngram", {"tree": "beam:2x2", "lookup_tree": "trie:2x2"}, SamplingParams(temperature=1.0)),
]


@pytest.mark.parametrize("drafter, options, params", LOOKUP_CASES, ids=["ngram-trie-filtered", "fused"])
def test_lookup_drafts_keep_the_target_distribution(pair, drafter, options, params):
    target, draft = pair
    p = _pvalue(target, draft, drafter, params, options, prompt=LOOKUP_PROMPT)
    assert p > ALPHA, f"sampled sequences do not follow the target's law (p={p:.2e})"


def test_plain_sampling_matches_target_distribution(pair):
    target, _ = pair
    assert _pvalue(target, None, None, SamplingParams(temperature=1.0)) > ALPHA


def test_biased_verification_is_detected(pair, monkeypatch):
    """Resampling from p instead of the residual after a rejection biases output; the test must catch it."""
    target, draft = pair
    real = engine_mod.verify_batch

    def biased(tokens, parents, valid, logits, temperature, top_k, top_p, mode, q, u, bonus_u, **kw):
        res = real(tokens, parents, valid, logits, temperature, top_k, top_p, mode, q, u, bonus_u, **kw)
        final = res.path.gather(1, (res.path_len - 1)[:, None])[:, 0]
        had_kids = ((parents == final[:, None]) & valid).any(1)
        rows = torch.arange(tokens.shape[0])
        p = warp_logits_rows(logits[rows, final], temperature, top_k, top_p)
        wrong = sample_inverse_cdf(p, bonus_u[rows, final])  # from p itself, ignoring the residual
        bonus = torch.where(had_kids, wrong, res.bonus)
        res.out_tokens[rows, res.path_len - 1] = bonus
        res.bonus.copy_(bonus)
        return res

    monkeypatch.setattr(engine_mod, "verify_batch", biased)
    p = _pvalue(target, draft, "static-tree", SamplingParams(temperature=1.0), {"tree_widths": "3,2"})
    assert p < ALPHA, f"a biased verifier went undetected (p={p:.3f})"
    p = _pvalue(target, draft, "ngram", SamplingParams(temperature=1.0), {"lookup_tree": "trie:2x2"},
                prompt=LOOKUP_PROMPT)
    assert p < ALPHA, f"a biased verifier went undetected under lookup drafts (p={p:.3f})"
