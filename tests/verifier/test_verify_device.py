"""Tests for verifier/verify_device.py: exact agreement with the CPU reference, greedy ties, lossless law.

Exactness: on random padded batches (chains, stars, random shapes; greedy and sampled rows mixed;
random top-k/top-p) the device verifier in float64 returns the reference's path and bonus given the
same uniforms. Law: the first two emitted tokens follow the target's warped law (chi-square at
false-alarm rate ALPHA, fixed seeds), and the same check rejects a deliberately biased acceptance.
"""

from __future__ import annotations

import pytest
import torch

from stat_helpers import assert_same_distribution, chisquare_pvalue
from stree.protocols.sampling import SamplingParams, sample_inverse_cdf, warp_logits, warp_logits_rows
from stree.protocols.token_tree import DraftMode, TokenTree, TreeBatch
from stree.kernels import sampled_verify
from stree.verifier.decode.verify import verify_tree
from stree.protocols.token_tree import ancestor_mask
from stree.verifier.decode.verify_device import tree_bounds, verify_batch
from verify_toys import ALPHA, PARAMS, WOR_P, ToyBatch, wor_first_tokens

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (torch.softmax pays ~10 ms per call on a busy
    2-core box), so this module runs single-threaded and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODES = list(DraftMode)


# ----- helpers ---------------------------------------------------------------------------------------
def _random_tree(gen: torch.Generator, vocab: int) -> TokenTree:
    n = int(torch.randint(1, 13, (), generator=gen))
    shape = int(torch.randint(0, 3, (), generator=gen))
    if shape == 0:  # chain
        parents = [-1] + list(range(n - 1))
    elif shape == 1:  # star
        parents = [-1] + [0] * (n - 1)
    else:
        parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return TokenTree(tokens=tokens, parents=parents)


def _random_params(gen: torch.Generator, vocab: int, greedy_share: float = 0.3) -> SamplingParams:
    if float(torch.rand((), generator=gen)) < greedy_share:
        return SamplingParams()
    temperature = 0.4 + 1.2 * float(torch.rand((), generator=gen))
    top_k = [0, 0, 1, 2, 3, vocab, vocab + 2][int(torch.randint(0, 7, (), generator=gen))]
    top_p = 0.3 + 0.7 * float(torch.rand((), generator=gen))
    top_p = 1.0 if float(torch.rand((), generator=gen)) < 0.5 else top_p
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _random_draft_probs(gen, n, vocab):
    """Draft laws with random zeros (children q could not draw are skipped) and some all-zero rows."""
    q = torch.rand(n, vocab, generator=gen, dtype=torch.float64) ** 3
    q = q * (torch.rand(n, vocab, generator=gen) > 0.25)
    q[torch.rand(n, generator=gen) < 0.1] = 0.0
    return q


def _param_tensors(params: list[SamplingParams]):
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64)
    return temperature, top_k, top_p


def _pad(rows: list[torch.Tensor], n: int, value=0.0) -> torch.Tensor:
    out = torch.full((len(rows), n) + tuple(rows[0].shape[1:]), value, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def _call(tensors, mode, max_depth, max_width, prob_dtype):
    *head, probs, uniforms, bonus_uniforms = tensors
    return verify_batch(*head, mode, probs, uniforms, bonus_uniforms, max_depth, max_width,
                        prob_dtype=prob_dtype)


class Case:
    """A random padded batch with its per-row trees, params, logits, draft laws and uniforms."""

    def __init__(self, seed: int, mode: DraftMode, batch=None, slack=True, greedy_share=0.3, vocab=None,
                 pad_to=None):
        gen = torch.Generator().manual_seed(seed)
        self.seed, self.mode = seed, mode
        vocab = vocab or int(torch.randint(2, 8, (), generator=gen))
        b = batch or int(torch.randint(1, 6, (), generator=gen))
        trees = [_random_tree(gen, vocab) for _ in range(b)]
        n = max(t.num_nodes for t in trees) + int(torch.randint(0, 3, (), generator=gen))  # extra padding
        n = pad_to or n
        self.params = [_random_params(gen, vocab, greedy_share) for _ in range(b)]
        logits = [torch.randn(t.num_nodes, vocab, generator=gen) * 2 for t in trees]
        probs = [_random_draft_probs(gen, t.num_nodes, vocab) for t in trees]
        if mode is not DraftMode.DETERMINISTIC:
            trees = [TokenTree(t.tokens, t.parents, draft_probs=q, mode=mode) for t, q in zip(trees, probs)]
        self.trees, self.logits = trees, logits
        self.batch = TreeBatch.from_trees(trees, pad_to=n)
        self.valid = torch.arange(n) < self.batch.num_nodes.unsqueeze(1)
        self.logits_pad = _pad(logits, n)
        self.probs_pad = _pad(probs, n) if mode is not DraftMode.DETERMINISTIC else None
        self.uniforms = torch.rand(b, n, generator=gen, dtype=torch.float64)
        self.bonus_uniforms = torch.rand(b, n, generator=gen, dtype=torch.float64)
        depth, width = tree_bounds(trees)
        extra = torch.randint(0, 3, (2,), generator=gen).tolist() if slack else [0, 0]
        self.max_depth, self.max_width = depth + extra[0], width + extra[1]

    def tensors(self) -> list:
        """verify_batch's tensor arguments in order (draft_probs may be None)."""
        return [self.batch.tokens, self.batch.parents, self.valid, self.logits_pad,
                *_param_tensors(self.params), self.probs_pad, self.uniforms, self.bonus_uniforms]

    def device(self, prob_dtype=torch.float64, max_depth=None, max_width=None):
        max_depth = self.max_depth if max_depth is None else max_depth
        max_width = self.max_width if max_width is None else max_width
        return _call(self.tensors(), self.mode, max_depth, max_width, prob_dtype)

    def reference(self, b: int, keep=None):
        """The CPU reference on row b (optionally on the subtree of nodes ``keep``, renumbered)."""
        tree, n = self.trees[b], self.trees[b].num_nodes
        keep = list(range(n)) if keep is None else keep
        new_id = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_id[int(tree.parents[i])] for i in keep[1:]]
        probs = None if tree.draft_probs is None else tree.draft_probs[keep]
        sub = TokenTree(tree.tokens[keep], parents, draft_probs=probs, mode=tree.mode)
        res = verify_tree(sub, self.logits[b][keep], self.params[b],
                          uniforms=self.uniforms[b, keep], bonus_uniforms=self.bonus_uniforms[b, keep])
        return [keep[i] for i in res.path], res.bonus_token, res.accepted_tokens(sub)


def _row(result, b):
    k = int(result.path_len[b])
    return result.path[b, :k].tolist(), int(result.bonus[b]), result.out_tokens[b, :k].tolist()


def _assert_row_matches(case: Case, result, b: int, keep=None):
    path, bonus, emitted = case.reference(b, keep)
    width = result.path.shape[1]
    msg = f"seed={case.seed} mode={case.mode.value} row={b} params={case.params[b]} tree={case.trees[b]}"
    assert _row(result, b) == (path, bonus, emitted), msg
    assert int(result.num_out[b]) == len(emitted), msg
    assert result.path[b, len(path):].tolist() == [0] * (width - len(path)), msg
    assert result.out_tokens[b, len(emitted):].tolist() == [0] * (width - len(emitted)), msg


# ----- building blocks ---------------------------------------------------------------------------------
def _rows_with_ties(seed: int):
    """24 rows' sampling parameters and ``[24, 5, V]`` logits with exact ties and some -inf entries."""
    gen = torch.Generator().manual_seed(seed)
    vocab = [3, 7, 50, 257][seed]
    params = [_random_params(gen, vocab, greedy_share=0.2) for _ in range(24)]
    logits = torch.randn(24, 5, vocab, generator=gen) * 3
    logits[::3] = torch.randint(-2, 3, (8, 5, vocab), generator=gen).float()  # exact ties
    logits[1::5, :, 0] = float("-inf")
    return params, logits


@pytest.mark.parametrize("seed", range(4))
def test_warp_logits_rows_matches_warp_logits_row_by_row(seed):
    params, logits = _rows_with_ties(seed)
    warped = warp_logits_rows(logits, *_param_tensors(params))
    assert warped.dtype == torch.float32
    for b, p in enumerate(params):
        assert torch.equal(warped[b], warp_logits(logits[b], p)), f"seed={seed} row={b} params={p}"
        for i in range(5):  # 1-D rows, as the reference warps them
            assert torch.equal(warped[b, i], warp_logits(logits[b, i], p)), f"seed={seed} row={b}"


@pytest.mark.parametrize("seed", range(4))
def test_filtered_logits_carry_the_warped_law(seed):
    """``filter_logits_rows`` (what the sampled kernel receives): softmax(filtered / T) is ``warp_logits_rows``'
    law on every sampled row, the kept set is exactly the warp's support (ties and -inf logits included), and
    greedy rows are untouched."""
    from stree.protocols.sampling import filter_logits_rows

    params, logits = _rows_with_ties(seed)
    temperature, top_k, top_p = _param_tensors(params)
    warped = warp_logits_rows(logits, temperature, top_k, top_p)
    filtered = filter_logits_rows(logits, temperature, top_k, top_p)
    for b, p in enumerate(params):
        if p.temperature == 0:
            assert torch.equal(filtered[b], logits[b])
            continue
        law = torch.softmax(filtered[b] / p.temperature, dim=-1)
        assert torch.equal(law > 0, warped[b] > 0), f"seed={seed} row={b} params={p}"
        torch.testing.assert_close(law, warped[b], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_warp_without_filters_equals_all_rows_off(seed):
    """``top_k``/``top_p`` None (no row filters: both vocabulary sorts skipped) gives the very same
    probabilities as rows whose filters are all off."""
    gen = torch.Generator().manual_seed(seed)
    vocab = [7, 50, 257][seed]
    logits = torch.randn(6, 4, vocab, generator=gen) * 3
    temperature = torch.rand(6, generator=gen) * 1.5
    temperature[0] = 0.0
    off = warp_logits_rows(logits, temperature, torch.zeros(6, dtype=torch.long), torch.ones(6))
    assert torch.equal(warp_logits_rows(logits, temperature, None, None), off), f"seed={seed}"


def test_ancestor_mask_matches_tree_batch():
    gen = torch.Generator().manual_seed(0)
    trees = [_random_tree(gen, 4) for _ in range(30)]
    trees += [TokenTree.chain(list(range(40))), TokenTree.chain([1]), TokenTree.chain([1, 2])]
    for group in (trees, trees[-2:-1], trees[-1:]):
        batch = TreeBatch.from_trees(group)
        mask = ancestor_mask(batch.parents)
        for b, row in enumerate(batch.parents.tolist()):  # reference: walk up from every node
            want = torch.zeros(len(row), len(row), dtype=torch.bool)
            for i in range(len(row)):
                j = i
                while j >= 0:
                    want[i, j] = True
                    j = row[j] if j > 0 else -1
            assert torch.equal(mask[b], want)


def test_sample_inverse_cdf_edges():
    p = torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64)
    cases = {0.0: 1, 0.25: 1, 0.4999: 1, 0.5: 3, 0.9999: 3, 1.0: 3}  # u rounding to 1 stays in support
    for u, token in cases.items():
        assert int(sample_inverse_cdf(p, torch.tensor(u))) == token
        assert int(sample_inverse_cdf(4 * p, torch.tensor(u))) == token  # unnormalized: u * total
    tail = torch.tensor([0.3, 0.7, 0.0, 0.0])
    assert int(sample_inverse_cdf(tail, torch.tensor(1.0))) == 1
    rows = torch.stack([p, p.flip(0)])
    assert sample_inverse_cdf(rows, torch.tensor([0.6, 0.2])).tolist() == [3, 0]


def test_reference_without_uniforms_is_unchanged():
    case = Case(5, DraftMode.IID, batch=1, greedy_share=0.0)
    tree, logits, params = case.trees[0], case.logits[0], case.params[0]
    runs = [verify_tree(tree, logits, params, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="uniforms must be a 1-D tensor"):
        verify_tree(tree, logits, params, uniforms=torch.rand(tree.num_nodes + 1))


# ----- exact agreement with the reference --------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_device_equals_reference_float64(mode):
    for seed in range(50):
        case = Case(seed, mode)
        result = case.device()
        for b in range(len(case.trees)):
            _assert_row_matches(case, result, b)


def test_device_equals_reference_on_mostly_accepting_trees():
    """Trees drawn along the target's own argmax chain so that deep acceptances actually happen."""
    accepted = 0
    for seed in range(60):
        case = Case(seed, MODES[seed % 3], greedy_share=0.2)
        for b, tree in enumerate(case.trees):  # re-token every node as the argmax after its parent
            logits = case.logits[b] + 0.0
            tokens = tree.tokens.clone()
            for i in range(1, tree.num_nodes):
                tokens[i] = int(logits[int(tree.parents[i])].argmax()) if i % 4 else tokens[i]
            case.trees[b] = TokenTree(tokens, tree.parents, draft_probs=tree.draft_probs, mode=tree.mode)
            case.batch.tokens[b, : tree.num_nodes] = tokens
        result = case.device()
        for b in range(len(case.trees)):
            _assert_row_matches(case, result, b)
        accepted += int((result.path_len - 1).sum())
    assert accepted > 100


def _truncated(tree: TokenTree, max_depth: int, max_width: int) -> list[int]:
    """Nodes kept when deeper nodes and children past the first max_width are cut (with subtrees)."""
    keep, rank = [0], {}
    kept = {0}
    for i in range(1, tree.num_nodes):
        parent = int(tree.parents[i])
        rank[parent] = rank.get(parent, -1) + 1
        if parent in kept and rank[parent] < max_width and int(tree.depth[i]) <= max_depth:
            keep.append(i)
            kept.add(i)
    return keep


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_static_bounds_truncate_the_trees(mode):
    for seed in range(30):
        case = Case(seed + 1000, mode, slack=False)
        depth, width = max(case.max_depth - 1, 0), max(case.max_width - 1, 0)
        result = case.device(max_depth=depth, max_width=width)
        assert result.path.shape[1] == depth + 1
        for b, tree in enumerate(case.trees):
            _assert_row_matches(case, result, b, keep=_truncated(tree, depth, width))


def test_float32_default_agrees_almost_everywhere():
    rows = same = 0
    for seed in range(30):
        case = Case(seed, MODES[seed % 3])
        exact, fast = case.device(torch.float64), case.device()
        for b in range(len(case.trees)):
            rows += 1
            same += _row(exact, b) == _row(fast, b)
    assert same >= 0.98 * rows, f"float32 agreed on {same} of {rows} rows"


def test_no_value_is_read_on_the_host():
    """On meta tensors (shapes, no values) any .item(), bool(), nonzero or mask index would raise."""
    for mode in (DraftMode.DETERMINISTIC, DraftMode.WITHOUT_REPLACEMENT):  # every op of all modes
        meta = [None if t is None else t.to("meta") for t in Case(3, mode, batch=4).tensors()]
        res = _call(meta, mode, 2, 2, torch.float32)  # ops on meta run slowly: small loop bounds
        assert res.path.device.type == "meta" and res.path.shape == (4, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cuda_graph_replay_equals_eager_and_reference(mode):
    """No sync in eager mode (sync debug mode raises), one capture replays every later batch exactly."""
    from stree.kernels.cuda_graph import capture_graph

    cases = [Case(seed, mode, batch=5, vocab=7, pad_to=14) for seed in range(30)]
    on_gpu = lambda case: [None if t is None else t.cuda() for t in case.tensors()]  # noqa: E731
    static = on_gpu(cases[0])
    run = lambda tensors: _call(tensors, mode, 13, 13, torch.float64)  # noqa: E731
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(static)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, out = capture_graph(lambda: run(static))
    rows = same = 0
    for case in cases:
        fresh = on_gpu(case)
        for buf, t in zip(static, fresh):
            if buf is not None:
                buf.copy_(t)
        graph.replay()
        eager = run(fresh)
        for name in ("path", "path_len", "bonus", "out_tokens", "num_out"):
            assert torch.equal(getattr(out, name), getattr(eager, name)), f"seed={case.seed} {name}"
        cpu = case.device(max_depth=13, max_width=13)
        for b in range(5):
            rows += 1
            same += _row(cpu, b) == _row(eager, b)
    assert same >= 0.98 * rows, f"CUDA agreed with the CPU on {same} of {rows} rows"


def test_bad_static_arguments_raise_value_error():
    case = Case(0, DraftMode.IID, batch=2)
    tensors = case.tensors()
    with pytest.raises(ValueError, match="needs draft_probs"):
        _call(tensors[:7] + [None] + tensors[8:], DraftMode.IID, 3, 3, torch.float64)
    with pytest.raises(ValueError, match="max_width must be a Python int"):
        _call(tensors, DraftMode.IID, 3, torch.tensor(3), torch.float64)
    with pytest.raises(ValueError, match="uniforms must be"):
        _call(tensors[:8] + [tensors[8][:, :-1], tensors[9]], DraftMode.IID, 3, 3, torch.float64)


# ----- greedy --------------------------------------------------------------------------------------------
def test_greedy_duplicates_and_ties_match_reference():
    gen = torch.Generator().manual_seed(7)
    for seed in range(80):
        case = Case(seed + 500, DraftMode.DETERMINISTIC, greedy_share=1.0)
        for b, tree in enumerate(case.trees):  # tiny vocab, integer logits: duplicate siblings, ties
            vocab = case.logits[b].shape[1]
            case.logits[b] = torch.randint(0, 2, (tree.num_nodes, vocab), generator=gen).float()
            case.logits_pad[b, : tree.num_nodes] = case.logits[b]
        result = case.device()
        for b in range(len(case.trees)):
            _assert_row_matches(case, result, b)


def test_greedy_hand_built_cases():
    trees = [
        TokenTree(tokens=[5, 1, 2, 3, 4], parents=[-1, 0, 0, 1, 2]),
        TokenTree(tokens=[0, 1, 1, 2], parents=[-1, 0, 0, 2]),  # duplicate siblings: deeper wins
        TokenTree(tokens=[0, 1, 1], parents=[-1, 0, 0]),  # duplicate leaves: lower index wins
    ]
    argmaxes = [[2, 3, 4, 1, 0], [1, 0, 2, 3], [1, 4, 5]]
    batch = TreeBatch.from_trees(trees)
    logits = torch.zeros(3, batch.max_nodes, 6)
    for b, row in enumerate(argmaxes):
        logits[b, torch.arange(len(row)), torch.tensor(row)] = 1.0
    valid = torch.arange(batch.max_nodes) < batch.num_nodes.unsqueeze(1)
    u = torch.zeros(3, batch.max_nodes)  # greedy rows ignore the uniforms
    greedy = (torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    res = verify_batch(batch.tokens, batch.parents, valid, logits, *greedy, DraftMode.DETERMINISTIC, None,
                       u, u, 2, 2)
    assert [_row(res, b) for b in range(3)] == [([0, 2, 4], 0, [2, 4, 0]), ([0, 2, 3], 3, [1, 2, 3]),
                                                ([0, 1], 4, [1, 4])]


def test_padding_is_never_accepted():
    """Padding nodes carry the argmax token and a generous draft law, yet are never on the path."""
    tree = TokenTree(tokens=[0, 3], parents=[-1, 0])
    batch = TreeBatch.from_trees([tree, tree], pad_to=5)
    logits = torch.full((2, 5, 4), -5.0)
    logits[:, :, 0] = 5.0  # the target wants token 0: exactly the padding token
    valid = torch.arange(5) < batch.num_nodes.unsqueeze(1)
    q = torch.full((2, 5, 4), 0.25)
    params = (torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long), torch.ones(2))
    for mode in MODES:
        u = torch.full((2, 5), 0.999)  # rejects the real child (p = 5e-5), so padding would be next
        res = verify_batch(batch.tokens, batch.parents, valid, logits, *params, mode, q,
                           u, torch.zeros(2, 5), 1, 4)
        assert res.path_len.tolist() == [1, 1]
        assert res.bonus.tolist() == [0, 0]


# ----- distribution: the first two emitted tokens follow the target (toys in tests/verify_toys.py) ----------
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(PARAMS))
def test_device_sampling_matches_target_law(mode, name):
    toy = ToyBatch(PARAMS[name], mode)
    samples, num_out = toy.first_two()
    assert int(num_out.max()) >= 3, "trees should sometimes accept two drafted tokens"
    assert_same_distribution(samples, toy.exact_law(), ALPHA)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_biased_acceptance_is_detected(monkeypatch, mode):
    """Accepting when u * q < 1.5 p (too often) must fail the same chi-square test."""
    monkeypatch.setattr(sampled_verify, "_accepts", lambda u, q_x, p_x: u * q_x < 1.5 * p_x)
    toy = ToyBatch(PARAMS["t1.4-topp0.8"], mode)
    samples, _ = toy.first_two()
    assert chisquare_pvalue(samples, toy.exact_law()) < ALPHA


def test_without_replacement_one_level_is_exact():
    assert_same_distribution(wor_first_tokens(), dict(enumerate(WOR_P)), ALPHA)


def test_without_replacement_needs_its_own_rule(monkeypatch):
    monkeypatch.setattr(sampled_verify, "_remove", lambda q, x: q)
    assert chisquare_pvalue(wor_first_tokens(), dict(enumerate(WOR_P))) < ALPHA
