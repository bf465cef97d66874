"""The ``mamba`` drafter: a small Mamba2 (or hybrid) draft model growing chain, static, beam or dynamic trees.

The session keeps the draft model's own state in step with the accepted tokens (it has fed every context token
but the last); it forks (``ForkableSession``: a copy of that state, of its context and of its random generator) so
that the drafter service can draft ahead from hypothetical outcomes. Each draft level is one batched ``step`` over
the frontier; leaves are never fed; on CUDA a whole draft (chain, static or beam) replays one graph, and so does each
commit step. Greedy drafting picks top-k children (point masses); with T > 0, chain and static trees draw children
without replacement (Gumbel-top-k) from the warped draft distribution and carry it, so verification stays lossless.
Beam and dynamic trees are deterministic at every temperature.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional, Sequence

import torch

from stree.protocols.device_drafter import DeviceOffer
from stree.protocols.drafter import ContextSession, DraftBudget
from stree.protocols.sampling import SamplingParams
from stree.protocols.token_tree import TokenTree

from stree.drafter_service.drafters.mamba.beam_search import GraphedBeamSearch, beam_search, draft_log_q, to_tree
from stree.drafter_service.drafters.mamba.static_tree_search import GraphedStaticTree, draw_uniforms, frontier_sizes, static_tree_search, to_static_tree
from stree.protocols.tree_shape import TreeShape
from stree.drafter_service.drafters.mamba.device_draft import DeviceTreeDrafter
from stree.drafter_service.drafters.mamba.runner_pool import RunnerPool

log = logging.getLogger(__name__)

# ``--tree auto``: the shapes the engine chooses among by measured goodput, plain decoding included; chains of
# every length up to 4 cost no exploring of their own (a chain's steps measure every shorter one per depth)
AUTO_SHAPES = tuple(TreeShape.parse(s) for s in ("none", "chain:1", "chain:2", "chain:3", "chain:4", "beam:4x2",
                                                  "beam:5x3"))


class MambaDrafter:
    """Drafter plugin over a draft ``StreeLM``; ``tree`` is a ``TreeShape`` spec such as ``beam:4x3``."""

    name = "mamba"

    def __init__(self, draft_model, tree: str | TreeShape = "beam:4x3", max_seqlen: int = 8192,
                 vocab_keep: Optional[torch.Tensor] = None, cuda_graphs: bool = True):
        if draft_model is None:
            raise ValueError("the mamba drafter needs a draft model: pass draft_model (a model from stree.load_model)")
        self.model = draft_model
        self.auto = tree == "auto"
        if self.auto:
            tree = str(AUTO_SHAPES[-1])  # what a host session drafts (the server's loop)
        self.shape = tree if isinstance(tree, TreeShape) else TreeShape.parse(tree)
        self.max_seqlen = max_seqlen
        # VocabTrim: draft only among these tokens (a cheaper LM head; never changes output)
        self.head = draft_model.trimmed_head(vocab_keep) if vocab_keep is not None else None
        self.cuda_graphs = cuda_graphs
        self.graphed_beams: dict = {}
        self.graphed_static: dict = {}
        self.static_graphs_failed = False
        self.runners = RunnerPool(draft_model)  # graphed commit runners, shared by sessions and their forks
        self._device = None

    def open(self, prompt_ids: Sequence[int], params: SamplingParams) -> "MambaDraftSession":
        return MambaDraftSession(self, prompt_ids, params)

    def device_drafter(self) -> Optional[DeviceOffer]:
        """Its ``DeviceTreeDrafter`` and shapes for the batched engine, or None for shapes it cannot lay out.

        ``auto`` offers plain decoding, chains and trees; the engine picks per step by goodput.
        """
        shapes = list(AUTO_SHAPES) if self.auto else [self.shape]
        if not all(s.kind in DeviceTreeDrafter.KINDS + ("none",) for s in shapes):
            return None
        if self._device is None:  # one per drafter: the engine that holds it keeps its graphs
            self._device = DeviceTreeDrafter(self.model, self.head)
        return DeviceOffer(self._device, shapes)


class MambaDraftSession(ContextSession):
    def __init__(self, drafter: MambaDrafter, prompt_ids: Sequence[int], params: SamplingParams):
        super().__init__(prompt_ids, params)
        self.model = drafter.model
        self.shape = drafter.shape
        self.head = drafter.head
        # the whole beam draft replays one CUDA graph (pure Mamba2 draft models on CUDA)
        self.graphs = drafter.cuda_graphs and self.model.device.type == "cuda" and not self.model.config.attn_layer_idx \
            and not self.model.config.hybrid_layer_idx
        self.drafter = drafter
        dev = self.model.device
        # on CUDA the draft model's one-token step replays a graph over this session's own state, so
        # committing accepted tokens costs a few microseconds per token instead of an eager prefill
        self.runner = None
        if drafter.cuda_graphs and dev.type == "cuda":
            self.runner = drafter.runners.take(len(self.context) + drafter.max_seqlen)
            self.state = self.runner.state
        else:
            self.state = self.model.new_state(1, len(self.context) + drafter.max_seqlen)
        if len(self.context) > 1:
            self.model.prefill(torch.tensor([self.context[:-1]], device=dev), self.state)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        self.generator = torch.Generator().manual_seed(seed ^ 0x5D3A)

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if not tokens:
            return
        # one token per step, graphed or not: committing a path in parts (as drafting ahead does) then leaves the
        # same state, bit for bit, as committing it at once
        feed = [self.context[-1]] + tokens[:-1]
        step = self.runner.step if self.runner is not None else self.model.step
        for tok in feed:
            step(torch.tensor([tok], device=self.model.device), self.state)
        super().commit(tokens)

    def fork(self) -> "MambaDraftSession":
        """A copy (``ForkableSession``): its own context, random generator and draft-model state, the state in a
        runner of the same size on CUDA, so committing to the copy replays the same graph as committing here."""
        other = copy.copy(self)
        other.context = list(self.context)
        other.generator = torch.Generator()
        other.generator.set_state(self.generator.get_state())
        if self.runner is not None:
            other.runner = self.drafter.runners.take(self.runner.max_seqlen)
            other.state = other.runner.state
            other.state.copy_from(self.state)
        else:
            other.state = self.state.clone()
        return other

    def close(self) -> None:
        if self.runner is not None:
            self.drafter.runners.give(self.runner)
        self.state = None
        self.runner = None
        super().close()

    # ----- drafting -----------------------------------------------------------------------------
    def _step(self, tokens: list[int], state) -> torch.Tensor:
        return self.model.step(torch.tensor(tokens, device=self.model.device), state, self.head)

    def draft(self, budget: DraftBudget) -> TokenTree:
        kind = self.shape.kind
        if budget.max_nodes < 2 or budget.max_depth < 1:
            return self.root_only()
        if kind in ("chain", "static"):
            return self._draft_static(budget)
        if kind == "beam":
            return self._draft_beam(budget, self.shape.depth, self.shape.beams)
        return self._draft_dynamic(budget)

    def _draft_static(self, budget: DraftBudget) -> TokenTree:
        """Chain and static trees: every frontier node's top-W_d children (Gumbel-top-k when sampling)."""
        widths = tuple(min(w, budget.max_width) for w in self.shape.widths[: budget.max_depth])
        root = self.context[-1]
        batch = max(frontier_sizes(widths)[:-1])  # draft-state rows: the widest level that is fed
        uniforms = None
        if not self.params.greedy:
            uniforms = draw_uniforms(len(widths), batch, self.model.vocab_size, self.generator)
        graphed = None
        if self.graphs and not self.drafter.static_graphs_failed:
            cache = self.drafter.graphed_static  # shared by the drafter's sessions: captured once
            warp = SamplingParams(self.params.temperature, self.params.top_k, self.params.top_p)  # no seed
            key = (widths, warp)
            try:
                if key not in cache:
                    cache[key] = GraphedStaticTree(self.model, widths, warp, self.head)
                graphed = cache[key](self.state, root, uniforms)
            except Exception as exc:  # noqa: BLE001 - a capture failure costs speed, never output
                log.warning("static draft graph failed (%r); drafting eagerly from now on", exc)
                self.drafter.static_graphs_failed = True
                cache.pop(key, None)
        if graphed is not None:
            tokens, q_rows = graphed
        else:
            dev = self.model.device
            work = self.state.select(torch.zeros(batch, dtype=torch.long, device=dev))
            tokens, q_rows = static_tree_search(self.model, work, torch.tensor([root], device=dev), widths,
                                                self.params, self.head,
                                                None if uniforms is None else uniforms.to(dev))
        return to_static_tree(root, widths, tokens, q_rows, budget.max_nodes, self.model.vocab_size)

    def _draft_beam(self, budget: DraftBudget, depth: int, beams: int) -> TokenTree:
        """STree's beam tree: D steps of beam search with M beams; every beam token becomes a node."""
        beams = min(beams, budget.max_width)
        depth = min(depth, budget.max_depth)
        root = self.context[-1]
        if self.graphs:
            cache = self.drafter.graphed_beams  # shared by the drafter's sessions: captured once
            warp = SamplingParams(self.params.temperature, self.params.top_k, self.params.top_p)  # no seed
            key = (depth, beams, warp)
            if key not in cache:
                cache[key] = GraphedBeamSearch(self.model, depth, beams, warp, self.head)
            toks, parents, scores = cache[key](self.state, root)
        else:
            work = self.state.select(torch.zeros(beams, dtype=torch.long, device=self.model.device))
            root_t = torch.tensor([root], device=self.model.device)
            toks, parents, scores = beam_search(self.model, work, root_t, depth, self.params, self.head)
        return to_tree(root, toks, parents, scores, budget.max_nodes)

    def _draft_dynamic(self, budget: DraftBudget) -> TokenTree:
        """Grow the tree level by level, keeping the candidates with the highest path probability."""
        limit = min(self.shape.nodes, budget.max_nodes)
        tokens, parents, score = [self.context[-1]], [-1], [0.0]
        frontier, state = [0], self.state.clone()
        for _ in range(budget.max_depth):
            room = limit - len(tokens)
            if room <= 0:
                break
            logq = draft_log_q(self._step([tokens[f] for f in frontier], state), self.params).cpu()
            width = min(budget.max_width, logq.shape[1])
            cand_lp, cand_tok = torch.topk(logq, width, dim=-1)  # [F, W]
            cand = torch.tensor([score[f] for f in frontier])[:, None] + cand_lp
            flat = cand.reshape(-1)
            keep = min(room, budget.max_width, int(torch.isfinite(flat).sum()))
            if keep == 0:
                break
            best = torch.topk(flat, keep).indices.tolist()
            rows = []
            new_frontier = []
            for idx in sorted(best):
                r, c = divmod(idx, width)
                tokens.append(int(cand_tok[r, c]))
                parents.append(frontier[r])
                score.append(float(flat[idx]))
                new_frontier.append(len(tokens) - 1)
                rows.append(r)
            frontier = new_frontier
            state = state.select(torch.tensor(rows, device=self.model.device))
        return TokenTree(tokens, parents)


def make_mamba_drafter(draft_model=None, tree: Optional[str] = None, tree_widths=None, vocab_keep=None, **_):
    """Factory for the ``mamba`` drafter (default tree ``beam:4x3``; ``vocab_keep``: VocabTrim token ids)."""
    if tree is None and tree_widths is not None:
        tree = str(TreeShape.from_widths(tree_widths))
    return MambaDrafter(draft_model, tree or "beam:4x3", vocab_keep=vocab_keep)


def frequent_tokens(sequences, k: int) -> torch.Tensor:
    """The ``k`` most frequent token ids in ``sequences`` (VocabTrim's kept vocabulary)."""
    counts: dict[int, int] = {}
    for seq in sequences:
        for t in seq:
            counts[int(t)] = counts.get(int(t), 0) + 1
    if not counts:
        raise ValueError("frequent_tokens: no tokens to count")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return torch.tensor(ranked[:k], dtype=torch.long)


def make_chain_drafter(draft_model=None, num_speculative_tokens: int = 4, tree: Optional[str] = None, **_):
    """Vanilla speculative decoding: a chain of ``num_speculative_tokens`` draft tokens."""
    if tree is not None and not tree.startswith("chain:"):
        raise ValueError(f"the chain drafter takes a chain:K tree spec, got {tree!r}")
    return MambaDrafter(draft_model, tree or f"chain:{num_speculative_tokens}")


def make_static_tree_drafter(draft_model=None, tree_widths=None, tree: Optional[str] = None, **_):
    """Static tree from a per-depth width schedule (default 3,1,1,1: 13 nodes, width 3, depth 4)."""
    if tree is not None:
        return MambaDrafter(draft_model, tree)
    return MambaDrafter(draft_model, TreeShape.from_widths(tree_widths or (3, 1, 1, 1)))
