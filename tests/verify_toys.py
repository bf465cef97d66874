"""Toy verification problems with an exactly known law, shared by the device verifier's and the sampled kernel's
distribution tests: an order-1 Markov target and draft over a tiny vocabulary (trees drafted below ROOT), and one
level of three children drawn without replacement. ``verify`` is any function with ``sampled_verify_ref``'s
arguments returning ``(path, path_len, bonus, out_tokens)``."""

from __future__ import annotations

import torch
from stat_helpers import exact_sequence_distribution
from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import DraftMode
from stree.verifier.decode.verify_device import verify_batch

ALPHA = 1e-3  # false-alarm rate of each distribution test (seeds are fixed, so runs are repeatable)
VOCAB, ROOT = 6, 4
PARAMS = {
    "t0.7-topk3": SamplingParams(temperature=0.7, top_k=3),
    "t1.4-topp0.8": SamplingParams(temperature=1.4, top_p=0.8),
    "t1.4": SamplingParams(temperature=1.4),  # no filters: the fused kernel's case
}
BRANCHING = {DraftMode.DETERMINISTIC: (2, 2), DraftMode.IID: (3, 2), DraftMode.WITHOUT_REPLACEMENT: (3, 2)}
N_SAMPLES = 4000


def device_verify(*args):
    """``verify_batch`` (the engine's entry point) with the kernels' return convention."""
    res = verify_batch(*args)
    return res.path, res.path_len, res.bonus, res.out_tokens


class ToyBatch:
    """Order-1 Markov target and draft over a tiny vocabulary; B trees drafted below ROOT at once."""

    def __init__(self, params, mode, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.target = torch.randn(VOCAB, VOCAB, generator=g) * 1.5  # logits after each token
        self.p = warp_logits(self.target, params)
        self.q = warp_logits(0.6 * self.target + torch.randn(VOCAB, VOCAB, generator=g), params)
        self.params, self.mode, self.branching = params, mode, BRANCHING[mode]

    def _draw(self, q_rows, k, gen):
        """[rows, k] children of each row of q, and whether each is real (WOR can run out of support)."""
        if self.mode is DraftMode.IID:
            kids = torch.multinomial(q_rows, k, replacement=True, generator=gen)
            return kids, torch.ones_like(kids, dtype=torch.bool)
        if self.mode is DraftMode.WITHOUT_REPLACEMENT:  # Gumbel-top-k
            u = torch.rand(q_rows.shape, generator=gen, dtype=torch.float64).clamp_min(1e-300)
            keys = q_rows.double().log() - (-u.log()).log()
            kids = keys.topk(k, dim=-1).indices
            return kids, q_rows.gather(1, kids) > 0
        top = torch.argsort(q_rows, dim=-1, descending=True, stable=True)[:, :k]
        kids = torch.cat([top, top[:, :1]], dim=1)  # top-k plus a duplicate of the best
        return kids, torch.ones_like(kids, dtype=torch.bool)

    def trees(self, b, gen):
        """tokens, parents, valid [B, N] in level order; nodes below an unreal node are padding too."""
        tokens, parents = [torch.full((b,), ROOT)], [torch.full((b,), -1)]
        valid = [torch.ones(b, dtype=torch.bool)]
        frontier = [0]
        for k in self.branching:
            grown = []
            for node in frontier:
                kids, real = self._draw(self.q[tokens[node]], k, gen)
                for j in range(kids.shape[1]):
                    ok = real[:, j] & valid[node]
                    tokens.append(torch.where(ok, kids[:, j], 0))
                    parents.append(torch.where(ok, node, 0))
                    valid.append(ok)
                    grown.append(len(tokens) - 1)
            frontier = grown
        return torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(valid, 1)

    def first_two(self, n_samples=N_SAMPLES, seed=1, verify=device_verify):
        """First two tokens emitted by one device step (a second, plain target draw if it emitted one)."""
        gen = torch.Generator().manual_seed(seed)
        tokens, parents, valid = self.trees(n_samples, gen)
        n = tokens.shape[1]
        u, bonus_u = torch.rand(n_samples, n, generator=gen), torch.rand(n_samples, n, generator=gen)
        filtered = self.params.top_k > 0 or self.params.top_p < 1.0
        top_k = torch.full((n_samples,), self.params.top_k) if filtered else None
        top_p = torch.full((n_samples,), self.params.top_p) if filtered else None
        _, num_out, _, out = verify(tokens, parents, valid, self.target[tokens],
                                    torch.full((n_samples,), self.params.temperature), top_k, top_p, self.mode,
                                    self.q[tokens], u, bonus_u, len(self.branching), max(self.branching) + 1)
        first = out[:, 0]
        plain = torch.multinomial(self.p[first], 1, generator=gen).squeeze(1)
        second = torch.where(num_out >= 2, out[:, 1], plain)
        return list(zip(first.tolist(), second.tolist())), num_out

    def exact_law(self):
        return exact_sequence_distribution(lambda ctx: self.p[ctx[-1]], (ROOT,), 2)


# q = [.7, .1, .1, .1], p = [.05, .6, .3, .05], 3 children drawn without replacement: with the i.i.d.
# rule (q never updated) token 1 comes out w.p. 0.45 instead of 0.6.
WOR_P, WOR_Q = [0.05, 0.6, 0.3, 0.05], [0.7, 0.1, 0.1, 0.1]


def wor_first_tokens(n_samples=3000, seed=0, verify=device_verify):
    gen = torch.Generator().manual_seed(seed)
    q = torch.tensor(WOR_Q)
    kids = torch.stack([torch.multinomial(q, 3, generator=gen) for _ in range(n_samples)])
    tokens = torch.cat([torch.zeros(n_samples, 1, dtype=torch.long), kids], 1)
    parents = torch.tensor([-1, 0, 0, 0]).expand(n_samples, 4)
    logits = torch.tensor(WOR_P).log().expand(n_samples, 4, 4)
    ones = torch.ones(n_samples)
    _, _, _, out = verify(tokens, parents, torch.ones(n_samples, 4, dtype=torch.bool), logits, ones, None, None,
                          DraftMode.WITHOUT_REPLACEMENT, q.expand(n_samples, 4, 4),
                          torch.rand(n_samples, 4, generator=gen), torch.rand(n_samples, 4, generator=gen), 1, 3)
    return out[:, 0].tolist()
