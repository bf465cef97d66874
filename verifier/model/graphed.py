"""CUDA graphs for the decode hot path: the one-token step, the whole verify pass and the commit.

Without graphs a step of a 64-layer model is bound by kernel launches (DESIGN §5: 7–20x slower).
``GraphedLM`` owns one static ``LMState`` and captures, lazily and once per bucket, ``step``,
``tree_forward`` (every layer plus the LM head) for tree sizes padded to a bucket, and ``commit``
for each (tree bucket, path bucket). Replays read inputs from static buffers, so results are the
eager ones (tested on the GPU: greedy output with graphs equals plain greedy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stree.kernels.cuda_graph import capture_graph
from stree.protocols.token_tree import TreeBatch

from stree.verifier.model.lm import LMState, StreeLM, TreeActs

TREE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets=TREE_BUCKETS) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} nodes is more than the largest graphed tree bucket ({buckets[-1]})")


def pad_tree_batch(trees: TreeBatch, n: int) -> TreeBatch:
    """Pad to ``n`` nodes with extra children of the root (they never affect real nodes)."""
    extra = n - trees.max_nodes
    if extra == 0:
        return trees
    b = trees.batch_size
    return TreeBatch(
        tokens=torch.cat([trees.tokens, torch.zeros(b, extra, dtype=torch.long)], 1),
        parents=torch.cat([trees.parents, torch.zeros(b, extra, dtype=torch.long)], 1),
        depth=torch.cat([trees.depth, torch.ones(b, extra, dtype=torch.long)], 1),
        num_nodes=trees.num_nodes,
    )


@dataclass
class _TreeGraph:
    graph: torch.cuda.CUDAGraph
    inputs: TreeBatch
    anc: torch.Tensor
    logits: torch.Tensor
    acts: TreeActs


class GraphedLM:
    """A ``StreeLM`` whose step / tree_forward / commit replay CUDA graphs over a static state."""

    def __init__(self, model: StreeLM, batch_size: int = 1, max_seqlen: int = 4096):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.batch_size = batch_size
        self.max_seqlen = max_seqlen
        self.state = model.new_state(batch_size, max_seqlen)
        self._step = None
        self._trees: dict[int, _TreeGraph] = {}
        self._commits: dict[tuple[int, int], tuple] = {}

    # the model's read-only attributes
    vocab_size = property(lambda self: self.model.vocab_size)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)
    config = property(lambda self: self.model.config)

    def new_state(self, batch_size: int, max_seqlen: int) -> LMState:
        """The static state, emptied (one generation at a time per ``GraphedLM``)."""
        if batch_size != self.batch_size or max_seqlen > self.max_seqlen:
            raise ValueError(f"graphed model holds batch {self.batch_size} x {self.max_seqlen} slots; "
                             f"asked for {batch_size} x {max_seqlen}")
        self._copy_state(self.state, None)
        return self.state

    @staticmethod
    def _copy_state(dst: LMState, src: LMState | None) -> None:
        for i, layer in enumerate(dst.layers):
            for name, t in vars(layer).items():
                t.copy_(getattr(src.layers[i], name)) if src is not None else t.zero_()
        dst.seqlen.copy_(src.seqlen) if src is not None else dst.seqlen.zero_()

    def _own(self, state: LMState) -> None:
        if state is not self.state:
            raise ValueError("GraphedLM only runs on the state returned by its new_state()")

    def _capture(self, fn: Callable):
        """Capture ``fn``, then put the state back as it was before the warm-up runs."""
        snapshot = self.state.clone()
        try:
            graph, out = capture_graph(fn, warmup=2)
        finally:  # a failed capture must not leave the warm-up runs' steps behind either
            self._copy_state(self.state, snapshot)
        return graph, out

    # ----- the model's inference API ----------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, state: LMState) -> torch.Tensor:
        self._own(state)
        return self.model.prefill(input_ids, state)

    def step(self, input_ids: torch.Tensor, state: LMState) -> torch.Tensor:
        self._own(state)
        if self._step is None:
            ids = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
            graph, out = self._capture(lambda: self.model.step(ids, self.state))
            self._step = (graph, ids, out)
        graph, ids, out = self._step
        ids.copy_(input_ids)
        graph.replay()
        return out.clone()

    def _tree_graph(self, n: int) -> _TreeGraph:
        if n not in self._trees:
            b = self.batch_size
            parents = torch.zeros(b, n, dtype=torch.long)
            parents[:, 0] = -1
            depth = torch.ones(b, n, dtype=torch.long)
            depth[:, 0] = 0
            inputs = TreeBatch(torch.zeros(b, n, dtype=torch.long), parents, depth,
                               torch.full((b,), n, dtype=torch.long)).to(self.device)
            anc = inputs.to("cpu").ancestor_mask().to(self.device)
            graph, (logits, acts) = self._capture(lambda: self.model.tree_forward(inputs, self.state, anc))
            self._trees[n] = _TreeGraph(graph, inputs, anc, logits, acts)
        return self._trees[n]

    def tree_forward(self, trees: TreeBatch, state: LMState, anc_mask: torch.Tensor | None = None):
        self._own(state)
        n = bucket_for(trees.max_nodes)
        entry = self._tree_graph(n)
        padded = pad_tree_batch(trees.to("cpu"), n)
        entry.inputs.tokens.copy_(padded.tokens)
        entry.inputs.parents.copy_(padded.parents)
        entry.inputs.depth.copy_(padded.depth)
        entry.anc.copy_(padded.ancestor_mask())
        entry.graph.replay()
        return entry.logits[:, : trees.max_nodes], entry.acts

    def commit(self, state: LMState, acts: TreeActs, path: torch.Tensor, path_len: torch.Tensor) -> None:
        self._own(state)
        n = next((k for k, e in self._trees.items() if e.acts is acts), None)
        if n is None:
            raise ValueError("commit needs the activations of this GraphedLM's last tree_forward")
        m = bucket_for(path.shape[1])
        key = (n, m)
        if key not in self._commits:
            p = torch.zeros(self.batch_size, m, dtype=torch.long, device=self.device)
            plen = torch.ones(self.batch_size, dtype=torch.long, device=self.device)
            graph, _ = self._capture(lambda: self.model.commit(self.state, acts, p, plen))
            self._commits[key] = (graph, p, plen)
        graph, p, plen = self._commits[key]
        p.zero_()
        p[:, : path.shape[1]].copy_(path)
        plen.copy_(path_len)
        graph.replay()


def graphed(model: StreeLM, max_seqlen: int) -> GraphedLM:
    """The model's cached ``GraphedLM`` with room for ``max_seqlen`` tokens (re-made when too small)."""
    runner = getattr(model, "_graphed_lm", None)
    if runner is None or runner.max_seqlen < max_seqlen:
        size = max(4096, (max_seqlen + 4095) // 4096 * 4096)
        runner = GraphedLM(model, 1, size)
        model._graphed_lm = runner
    return runner
