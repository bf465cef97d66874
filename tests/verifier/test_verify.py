"""Tests for verifier/verify.py: greedy paths, lossless sampling (chi-square) in every draft mode, errors.

The distribution tests compare the first tokens emitted by speculative decoding of a toy
order-2 Markov "target" (drafted by a different toy "draft") with their exact law under plain
sampling. Each uses fixed seeds and a false-alarm rate ALPHA, and the power tests show the same
check rejects verifiers that are biased on purpose.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stat_helpers import assert_same_distribution, chisquare_pvalue, exact_sequence_distribution
from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import DraftMode, TokenTree
from stree.verifier.decode import verify as verify_module
from stree.verifier.decode.verify import VerifyResult, verify_tree

ALPHA = 1e-3  # false-alarm rate of each distribution test (seeds are fixed, so runs are repeatable)
VOCAB = 6
START = (2, 4)  # context before decoding: (previous token, root token)
LENGTH = 3  # emitted tokens compared per sample
N_SAMPLES = 2000

N_POWER = 1000  # the biased verifiers below are rejected with p < 1e-8 at this size
PLAIN = SamplingParams(temperature=1.0)
PARAMS = {  # warps checked in every draft mode
    "t0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1.4-topp0.8": SamplingParams(temperature=1.4, top_p=0.8),
}


# ----- toy target / draft ----------------------------------------------------------------------
class ToySpeculation:
    """Order-2 Markov target and draft over a tiny vocabulary, and trees drafted from the latter."""

    def __init__(self, params, mode, branching, seed=0, extra_child=None):
        g = torch.Generator().manual_seed(seed)
        self.target = torch.randn(VOCAB, VOCAB, VOCAB, generator=g) * 1.5
        draft_logits = 0.6 * self.target + torch.randn(VOCAB, VOCAB, VOCAB, generator=g)
        self.draft_q = warp_logits(draft_logits, params)  # same warp as the target gets
        self.params, self.mode, self.branching = params, mode, branching
        self.extra_child = extra_child  # an off-contract child appended under the root

    def target_probs(self, context: tuple) -> torch.Tensor:
        return warp_logits(self.target[context[-2], context[-1]], self.params)

    def exact_law(self, length=LENGTH):
        return exact_sequence_distribution(self.target_probs, START, length)

    def _children(self, q_rows, k, gen) -> list[list[int]]:
        """Children of each node of one tree level (one row of q per node), in draw order."""
        if self.mode is DraftMode.IID:
            return torch.multinomial(q_rows, k, replacement=True, generator=gen).tolist()
        if self.mode is DraftMode.WITHOUT_REPLACEMENT:  # Gumbel-top-k = successive draws w/o replacement
            u = torch.rand(q_rows.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
            keys = q_rows.double().log() - (-u.log()).log()
            order = torch.argsort(keys, dim=-1, descending=True).tolist()
            support = (q_rows > 0).sum(-1).tolist()
            return [o[: min(k, s)] for o, s in zip(order, support)]
        top = torch.argsort(q_rows, dim=-1, descending=True, stable=True)[:, :k].tolist()
        return [t + t[:1] for t in top]  # deterministic: top-k plus a duplicate of the best

    def build(self, context, gen):
        """Draft a tree below ``context``'s last token; return it and the target logits of every node."""
        tokens, parents, contexts = [context[-1]], [-1], [tuple(context[-2:])]
        frontier = [0]
        for k in self.branching:
            rows = torch.tensor([contexts[node] for node in frontier])
            kids = self._children(self.draft_q[rows[:, 0], rows[:, 1]], k, gen)
            grown = []
            for node, xs in zip(frontier, kids):
                for x in xs:
                    tokens.append(x)
                    parents.append(node)
                    contexts.append((tokens[node], x))
                    grown.append(len(tokens) - 1)
            frontier = grown
        if self.extra_child is not None:
            tokens.append(self.extra_child)
            parents.append(0)
            contexts.append((tokens[0], self.extra_child))
        rows = torch.tensor(contexts)
        probs = None
        if self.mode is not DraftMode.DETERMINISTIC:
            probs = self.draft_q[rows[:, 0], rows[:, 1]]
        tree = TokenTree(tokens=tokens, parents=parents, draft_probs=probs, mode=self.mode)
        return tree, self.target[rows[:, 0], rows[:, 1]]

    def sample(self, n_samples=N_SAMPLES, length=LENGTH, seed=1):
        """First ``length`` emitted tokens of ``n_samples`` speculative decodes, and tokens per step."""
        gen = torch.Generator().manual_seed(seed)
        samples, per_step = [], []
        for _ in range(n_samples):
            context, emitted = START, []
            while len(emitted) < length:
                tree, logits = self.build(context, gen)
                step = verify_tree(tree, logits, self.params, gen).accepted_tokens(tree)
                per_step.append(len(step))
                emitted += step
                context = (tuple(context) + tuple(step))[-2:]
            samples.append(tuple(emitted[:length]))
        return samples, per_step


MODES = {
    DraftMode.DETERMINISTIC: (2, 2),  # 1 + 3 + 9 nodes (duplicates included)
    DraftMode.IID: (3, 2),
    DraftMode.WITHOUT_REPLACEMENT: (3, 2),
}


# ----- distribution tests ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_sampling_matches_target_law(mode, name):
    toy = ToySpeculation(PARAMS[name], mode, MODES[mode])
    samples, per_step = toy.sample()
    assert max(per_step) >= 3, "trees should sometimes accept two drafted tokens"
    assert_same_distribution(samples, toy.exact_law(), ALPHA)


@pytest.mark.parametrize("mode", [DraftMode.IID, DraftMode.WITHOUT_REPLACEMENT], ids=lambda m: m.value)
def test_off_contract_child_is_skipped_and_law_kept(mode):
    """A child token q gives probability 0 (could not have been drawn) must not bias the output."""
    params = SamplingParams(temperature=0.8, top_k=2)  # q has 2 tokens of support: WOR exhausts it
    toy = ToySpeculation(params, mode, (3,), seed=3)
    toy.draft_q = toy.draft_q.clone()
    toy.draft_q[:, :, 5] = 0.0  # token 5 is never drafted ...
    toy.draft_q /= toy.draft_q.sum(-1, keepdim=True)
    toy.target[:, :, 5] += 4.0  # ... but the target likes it
    toy.extra_child = 5
    samples, _ = toy.sample(n_samples=1500, length=2)
    assert_same_distribution(samples, toy.exact_law(length=2), ALPHA)


def test_plain_sampling_matches_its_own_exact_law():
    """Sanity check of the helpers: root-only trees are plain sampling."""
    toy = ToySpeculation(PLAIN, DraftMode.DETERMINISTIC, ())
    samples, per_step = toy.sample(n_samples=1000)
    assert set(per_step) == {1}
    assert_same_distribution(samples, toy.exact_law(), ALPHA)


# ----- power: the same checks must reject biased verifiers ----------------------------------------
def _resample_from_target(p, q):
    return p  # biased: after a rejection, sample from p instead of the residual


BIASES = {
    "resample-from-p": ("_residual", _resample_from_target),
    "always-accept": ("_uniform", lambda generator: 0.0),  # accepts every child with p(x) > 0
}


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
@pytest.mark.parametrize("bias", list(BIASES))
def test_biased_verification_is_detected(monkeypatch, mode, bias):
    name, replacement = BIASES[bias]
    monkeypatch.setattr(verify_module, name, replacement)
    toy = ToySpeculation(PLAIN, mode, MODES[mode])
    samples, _ = toy.sample(n_samples=N_POWER)
    assert chisquare_pvalue(samples, toy.exact_law()) < ALPHA


def _first_tokens_one_level(p, q, mode, k, n_samples, seed=0):
    """Bonus-or-accepted first token of one-level trees: ``k`` children drawn from q below a root."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor(p).log()
    q = torch.tensor(q)
    out = []
    for _ in range(n_samples):
        kids = torch.multinomial(q, k, replacement=mode is DraftMode.IID, generator=gen).tolist()
        tree = TokenTree(tokens=[0] + kids, parents=[-1] + [0] * k,
                         draft_probs=q.expand(k + 1, -1), mode=mode)
        res = verify_tree(tree, logits.expand(k + 1, -1), PLAIN, gen)
        out.append(res.accepted_tokens(tree)[0])
    return out


# With q = [.7, .1, .1, .1] and p = [.05, .6, .3, .05], 3 children drawn without replacement and
# verified with the i.i.d. rule (q never updated) emit token 1 w.p. 0.45 instead of 0.6.
WOR_P, WOR_Q = [0.05, 0.6, 0.3, 0.05], [0.7, 0.1, 0.1, 0.1]


def test_without_replacement_one_level_is_exact():
    samples = _first_tokens_one_level(WOR_P, WOR_Q, DraftMode.WITHOUT_REPLACEMENT, 3, N_POWER)
    assert_same_distribution(samples, dict(enumerate(WOR_P)), ALPHA)


def test_without_replacement_needs_its_own_rule(monkeypatch):
    monkeypatch.setattr(verify_module, "_remove", lambda q, token: q)
    samples = _first_tokens_one_level(WOR_P, WOR_Q, DraftMode.WITHOUT_REPLACEMENT, 3, N_POWER)
    assert chisquare_pvalue(samples, dict(enumerate(WOR_P))) < ALPHA


# ----- greedy ---------------------------------------------------------------------------------------
def _logits_with_argmax(argmaxes, vocab=VOCAB):
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    for i, t in enumerate(argmaxes):
        logits[i, t] = 10.0
    return logits


def test_greedy_hand_built_tree():
    tree = TokenTree(tokens=[5, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 2])
    res = verify_tree(tree, _logits_with_argmax([2, 3, 4, 1, 0]), SamplingParams())
    assert res == VerifyResult(path=[0, 2, 4], bonus_token=0)
    assert res.accepted_tokens(tree) == [2, 4, 0]
    assert res.num_accepted == 2


def test_greedy_root_only_and_first_mismatch():
    root = TokenTree.chain([3])
    assert verify_tree(root, _logits_with_argmax([1]), SamplingParams()).path == [0]
    chain = TokenTree.chain([3, 1, 2])
    res = verify_tree(chain, _logits_with_argmax([1, 0, 4]), SamplingParams())
    assert (res.path, res.bonus_token) == ([0, 1], 0)


def test_greedy_duplicate_siblings_take_the_deeper_match():
    tree = TokenTree(tokens=[0, 1, 1, 2], parents=[-1, 0, 0, 2])
    res = verify_tree(tree, _logits_with_argmax([1, 0, 2, 3]), SamplingParams())
    assert (res.path, res.bonus_token) == ([0, 2, 3], 3)


@st.composite
def random_trees(draw):
    n = draw(st.integers(1, 14))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    return TokenTree(tokens=tokens, parents=parents), seed


@settings(max_examples=200, deadline=None, derandomize=True)
@given(random_trees())
def test_greedy_path_is_longest_argmax_path(case):
    tree, seed = case
    logits = torch.randn(tree.num_nodes, 3, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()

    def follows_argmax(node):
        path = tree.path(node)
        return all(tokens[c] == best[p] for p, c in zip(path, path[1:]))

    deepest = max(
        (i for i in range(tree.num_nodes) if follows_argmax(i)),
        key=lambda i: (len(tree.path(i)), -i),
    )
    res = verify_tree(tree, logits, SamplingParams())
    assert res.path == tree.path(deepest)
    assert res.bonus_token == best[deepest]


def test_top_k_1_sampling_equals_greedy():
    """With a one-hot target, sampling verification accepts exactly the greedy path."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        tree = TokenTree.from_sequences(0, torch.randint(0, VOCAB, (4, 3), generator=gen).tolist())
        logits = torch.randn(tree.num_nodes, VOCAB, generator=gen)
        greedy = verify_tree(tree, logits, SamplingParams())
        sampled = verify_tree(tree, logits, SamplingParams(temperature=1.0, top_k=1), gen)
        assert sampled == greedy


def test_sampling_is_reproducible_with_a_seeded_generator():
    toy = ToySpeculation(PLAIN, DraftMode.IID, (3, 2))
    tree, logits = toy.build(START, torch.Generator().manual_seed(5))
    runs = [
        verify_tree(tree, logits, toy.params, torch.Generator().manual_seed(9)) for _ in range(2)
    ]
    assert runs[0] == runs[1]


# ----- errors ----------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_error():
    tree = TokenTree(tokens=[0, 1, 2], parents=[-1, 0, 0])
    greedy, sample = SamplingParams(), SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="rows"):
        verify_tree(tree, torch.zeros(2, VOCAB), greedy)
    with pytest.raises(ValueError, match="2-D"):
        verify_tree(tree, torch.zeros(VOCAB), greedy)
    with pytest.raises(ValueError, match="vocabulary"):
        verify_tree(tree, torch.zeros(3, 2), greedy)
    nan = torch.zeros(3, VOCAB)
    nan[0, 1] = float("nan")
    with pytest.raises(ValueError, match="no valid distribution"):
        verify_tree(tree, nan, sample)
    iid = TokenTree(tokens=[0, 1, 2], parents=[-1, 0, 0], draft_probs=torch.full((3, 8), 0.125),
                    mode=DraftMode.IID)
    with pytest.raises(ValueError, match="draft_probs has vocabulary"):
        verify_tree(iid, torch.zeros(3, VOCAB), sample)
    negative = torch.full((3, VOCAB), 0.2)
    negative[0, 3] = -0.2
    with pytest.raises(ValueError, match="negative entries"):  # TokenTree itself refuses it now
        TokenTree(tokens=[0, 1, 2], parents=[-1, 0, 0], draft_probs=negative, mode=DraftMode.IID)
    # draft_probs is not copied: corrupt a valid tree's in place to reach the verifier's own check
    q = torch.full((3, VOCAB), 0.2)
    bad_q = TokenTree(tokens=[0, 1, 2], parents=[-1, 0, 0], draft_probs=q, mode=DraftMode.IID)
    q[0, 3] = -0.2
    with pytest.raises(ValueError, match="finite and >= 0"):
        verify_tree(bad_q, torch.zeros(3, VOCAB), sample)
