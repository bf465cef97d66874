"""Static draft trees (``chain:K``, ``static:W1,W2,..``) as device-side tensor code one CUDA graph can hold.

Level d expands every node of the frontier into its top-``W_d`` children: by the draft logits when
greedy, or by Gumbel-top-k (successive draws without replacement) from the warped draft
distribution when sampling, whose rows are returned for lossless verification. The draft state has
a fixed batch (the widest level), so shapes never change and ``GraphedStaticTree`` replays the
whole draft as one graph. The Gumbel noise comes from the session's seeded CPU generator, so a
seeded generation stays reproducible.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import DraftMode, TokenTree
from stree.kernels.cuda_graph import capture_graph

from stree.drafter_service.drafters.mamba.beam_search import _reorder_rows_, copy_state_


def frontier_sizes(widths: Sequence[int]) -> list[int]:
    """Nodes per level: 1 (the root), W1, W1*W2, ..."""
    sizes = [1]
    for w in widths:
        sizes.append(sizes[-1] * w)
    return sizes


def static_tree_search(model, state, root: torch.Tensor, widths: Sequence[int], params: SamplingParams,
                       head=None, uniforms: Optional[torch.Tensor] = None):
    """Expand ``root`` (``[1]``) level by level from ``state`` (batch = widest level, rows equal; updated in place).

    ``uniforms`` (``[levels, batch, vocab]`` in (0, 1)) switches on sampling. Returns per level the
    child tokens ``[F_d]`` and, when sampling, the warped draft rows ``[F_{d-1}, vocab]`` they were drawn from.
    """
    batch = state.seqlen.shape[0]
    sizes = frontier_sizes(widths)
    dev = root.device
    feed = root.reshape(1).expand(batch).contiguous()
    tokens, q_rows = [], []
    for d, w in enumerate(widths):
        f_prev, f = sizes[d], sizes[d + 1]
        logits = model.step(feed, state, head)[:f_prev]  # [F_prev, V]; rows past F_prev are padding
        if uniforms is None:
            picks = torch.topk(logits.float(), w, dim=-1).indices
        else:
            q = warp_logits(logits, params)
            gumbel = -torch.log(-torch.log(uniforms[d, :f_prev]))
            picks = torch.topk(torch.log(q) + gumbel, w, dim=-1).indices
            q_rows.append(q)
        children = picks.reshape(-1)  # [F], grouped by parent row
        tokens.append(children)
        if d + 1 < len(widths):  # leaves are never fed
            rows = torch.arange(f_prev, device=dev).repeat_interleave(w)
            pad = batch - f
            if pad:
                rows = torch.cat([rows, torch.zeros(pad, dtype=torch.long, device=dev)])
                children = torch.cat([children, children.new_zeros(pad)])
            _reorder_rows_(state, rows)
            feed = children
    return tokens, q_rows


def to_static_tree(root: int, widths: Sequence[int], tokens: list, q_rows: list, max_nodes: int,
                   vocab_size: int) -> TokenTree:
    """The ``TokenTree`` of a static search (nodes level by level, cut at ``max_nodes``).

    When sampling, a child the draft distribution gives no mass (fewer tokens in its support than
    the width) is dropped with its subtree, and each expanded node carries its draft row.
    """
    sampling = bool(q_rows)
    toks = [t.tolist() for t in tokens]
    q_host = [q.float().cpu() for q in q_rows] if sampling else []
    out_tokens, out_parents, row_of = [root], [-1], {}
    prev_ids: list[Optional[int]] = [0]
    for d, w in enumerate(widths):
        ids: list[Optional[int]] = []
        for j, tok in enumerate(toks[d]):
            r = j // w
            parent = prev_ids[r]
            dead = parent is None or len(out_tokens) >= max_nodes
            if not dead and sampling and float(q_host[d][r, tok]) <= 0.0:
                dead = True
            if dead:
                ids.append(None)
                continue
            if sampling:
                row_of[parent] = (d, r)
            out_tokens.append(int(tok))
            out_parents.append(parent)
            ids.append(len(out_tokens) - 1)
        prev_ids = ids
    if not sampling or len(out_tokens) == 1:
        return TokenTree(out_tokens, out_parents)
    probs = torch.zeros(len(out_tokens), vocab_size)
    for node, (d, r) in row_of.items():
        probs[node] = q_host[d][r]
    return TokenTree(out_tokens, out_parents, draft_probs=probs, mode=DraftMode.WITHOUT_REPLACEMENT)


class GraphedStaticTree:
    """One CUDA graph for a whole static (or chain) draft of a draft model (captured on first use)."""

    def __init__(self, model, widths: Sequence[int], params: SamplingParams, head=None, max_seqlen: int = 8192):
        self.model, self.widths, self.params, self.head = model, tuple(widths), params, head
        self.batch = max(frontier_sizes(widths)[:-1])  # rows that are ever fed
        self.src = model.new_state(1, max_seqlen)
        self.work = model.new_state(self.batch, max_seqlen)
        self.root = torch.zeros(1, dtype=torch.long, device=model.device)
        self.sampling = not params.greedy
        self.uniforms = (torch.full((len(widths), self.batch, model.vocab_size), 0.5, device=model.device)
                         if self.sampling else None)
        self.graph = None
        self.out = None

    def _run(self):
        copy_state_(self.work, self.src)
        return static_tree_search(self.model, self.work, self.root, self.widths, self.params, self.head,
                                  self.uniforms)

    def __call__(self, state, root: int, uniforms: Optional[torch.Tensor] = None):
        """(tokens, q rows) for a session whose committed ``state`` (batch 1) precedes token ``root``."""
        copy_state_(self.src, state)
        self.root.fill_(root)
        if self.sampling:
            self.uniforms.copy_(uniforms)
        if self.graph is None:
            self.graph, self.out = capture_graph(self._run)
        self.graph.replay()
        return self.out


def draw_uniforms(levels: int, batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """U(0, 1) noise for Gumbel-top-k, strictly inside (0, 1) so both logs stay finite."""
    return torch.rand(levels, batch, vocab, generator=generator).clamp_(min=1e-12, max=1.0 - 1e-7)
