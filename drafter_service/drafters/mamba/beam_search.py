"""STree's beam-search draft tree, as device-side tensor code that one CUDA graph can hold whole.

``beam_search`` runs D steps of beam search with M beams entirely on the device (no host sync:
top-k over beams x vocab, in-place reordering of the draft state's rows), returning the beam
tokens, parent beams and scores of every step. Every beam token is a tree node; ``to_tree`` turns
the tensors into a ``TokenTree`` on the host. ``GraphedBeamSearch`` captures the whole draft —
all D steps of the draft model — in one CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import TokenTree
from stree.kernels.cuda_graph import capture_graph
from stree.verifier.model.layer_stack import for_each_field, paired_field_stacks


def draft_log_q(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Beam scores: log-softmax for greedy drafting, else the log of the shared warped distribution."""
    if params.greedy:
        return torch.log_softmax(logits.float(), -1)
    return torch.log(warp_logits(logits, params))


def _reorder_rows_(state, rows: torch.Tensor) -> None:
    """Rows ``rows`` of ``state`` into its rows, in place: one gather per stacked field (``layer_stack``), not per layer."""
    for_each_field(state.layers, lambda t, dim: t.copy_(t.index_select(dim, rows)))
    state.seqlen.copy_(state.seqlen.index_select(0, rows))


def copy_state_(dst, src) -> None:
    """Copy a state into another in place; a batch-1 ``src`` fills every row of ``dst`` (one copy per stacked field)."""
    for name, index, view, s_view in paired_field_stacks(dst.layers, src.layers):
        if view is not None:
            view.copy_(s_view.expand_as(view))
            continue
        for i in index:
            t = getattr(dst.layers[i], name)
            t.copy_(getattr(src.layers[i], name).expand_as(t))
    dst.seqlen.copy_(src.seqlen.expand_as(dst.seqlen))


def beam_search(model, state, root: torch.Tensor, depth: int, params: SamplingParams, head=None):
    """Beam search from ``state`` (M identical rows, updated in place) after token ``root`` (``[1]``).

    Returns ``tokens [D, M]``, ``parent_beams [D, M]`` and ``scores [D, M]`` (``-inf`` marks a beam
    that had no finite candidate, e.g. under top-k with k < M).
    """
    beams = state.seqlen.shape[0]
    last = root.reshape(1).expand(beams).contiguous()
    # all rows start equal: only row 0 is expanded at the first step (no host copy: graph-safe)
    scores = torch.zeros(beams, device=root.device).masked_fill_(torch.arange(beams, device=root.device) > 0,
                                                                  float("-inf"))
    toks, parents, all_scores = [], [], []
    for _ in range(depth):
        logq = draft_log_q(model.step(last, state, head), params)  # [M, V]
        vocab = logq.shape[1]
        top = torch.topk((scores[:, None] + logq).reshape(-1), beams)
        rows = torch.div(top.indices, vocab, rounding_mode="floor")
        last = top.indices - rows * vocab
        _reorder_rows_(state, rows)
        scores = top.values
        toks.append(last)
        parents.append(rows)
        all_scores.append(scores)
    return torch.stack(toks), torch.stack(parents), torch.stack(all_scores)


def to_tree(root: int, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
            max_nodes: int) -> TokenTree:
    """Nodes depth by depth (so truncation keeps the shallow ones); beams with ``-inf`` score dropped."""
    tokens, parents, scores = tokens.tolist(), parents.tolist(), scores.tolist()
    out_tokens, out_parents = [root], [-1]
    prev_ids: list[Optional[int]] = [0] * len(tokens[0]) if tokens else []
    for d in range(len(tokens)):
        ids: list[Optional[int]] = []
        for j, (tok, par, sc) in enumerate(zip(tokens[d], parents[d], scores[d])):
            parent_id = 0 if d == 0 else prev_ids[par]
            if sc == float("-inf") or parent_id is None or len(out_tokens) >= max_nodes:
                ids.append(None)
                continue
            out_tokens.append(int(tok))
            out_parents.append(parent_id)
            ids.append(len(out_tokens) - 1)
        prev_ids = ids
    return TokenTree(out_tokens, out_parents)


class GraphedBeamSearch:
    """One CUDA graph for a whole D x M beam draft of a draft model (captured on first use)."""

    def __init__(self, model, depth: int, beams: int, params: SamplingParams, head=None, max_seqlen: int = 8192):
        self.model, self.depth, self.beams, self.params, self.head = model, depth, beams, params, head
        self.src = model.new_state(1, max_seqlen)  # the session's committed state is copied in here
        self.work = model.new_state(beams, max_seqlen)
        self.root = torch.zeros(1, dtype=torch.long, device=model.device)
        self.graph = None
        self.out = None

    def _run(self):
        copy_state_(self.work, self.src)
        return beam_search(self.model, self.work, self.root, self.depth, self.params, self.head)

    def __call__(self, state, root: int):
        """Beam tensors for a session whose committed ``state`` (batch 1) precedes token ``root``."""
        copy_state_(self.src, state)
        self.root.fill_(root)
        if self.graph is None:
            self.graph, self.out = capture_graph(self._run)
        self.graph.replay()
        return self.out
