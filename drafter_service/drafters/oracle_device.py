"""The ``oracle`` drafter on the device: right for exactly ``k`` levels, drafted inside the engine's step graph.

For benchmarks at real scale with random weights (no trained drafter exists), at any batch size:
each slot holds the known continuation of its prompt as a device row and a position; a draft lays
out a chain or static tree whose first node at depths 1..k carries the next continuation tokens and
every other node a token that is certainly wrong there. Greedy verification then accepts exactly
``k`` tokens plus the bonus, so ``tau = k + 1`` while the verifier pays for the whole tree. With
``accept_rates`` each draft draws each row's k from a recorded acceptance by depth instead (a projection of a real
drafter's acceptance onto this target's costs). The host ``OracleDrafter`` (``oracle.py``) is the fixed-k idea
one TokenTree at a time; ``open`` falls back to it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from stree.drafter_service.drafters.oracle import OracleDrafter
from stree.kernels import ops
from stree.kernels.keyed_random import DRAFT_LANE
from stree.protocols.device_drafter import DeviceDraft, DeviceDrafterBase, DeviceOffer
from stree.protocols.sampling import RowSampling, SamplingParams
from stree.protocols.token_tree import DraftMode
from stree.protocols.tree_shape import TreeShape


def wrong_salts(num_nodes: int, vocab_size: int, device) -> torch.Tensor:
    """``[N]`` offsets in ``1..V-1``, one per node: a token plus its node's offset (mod V) is a different token."""
    return 1 + (torch.arange(num_nodes, device=device) * 40503) % (vocab_size - 1)


class OracleDeviceDrafter(DeviceDrafterBase):
    """A ``Drafter`` (``open`` = the host oracle) whose ``device_drafter()`` is itself, over ``shapes``.

    ``set_continuation(prompt, continuation)`` registers what the target generates after ``prompt``;
    a slot whose prompt has none drafts arbitrary tokens (verification keeps its output exact).
    """

    name = "oracle"
    KINDS = ("chain", "static")

    def __init__(self, vocab_size: int, correct_depth: int, shapes: Sequence[TreeShape | str] | TreeShape | str,
                 device, accept_rates: Optional[Sequence[float]] = None):
        """``accept_rates`` (optional): a recorded acceptance to replay instead of a fixed ``correct_depth``:
        ``accept_rates[d - 1]`` is the chance that levels 1..d are right (non-increasing, in [0, 1], at most
        ``correct_depth`` of them). Each draft draws each row's right levels from it (one uniform per row)."""
        shapes = [shapes] if isinstance(shapes, (str, TreeShape)) else list(shapes)
        self.shapes = [s if isinstance(s, TreeShape) else TreeShape.parse(s) for s in shapes]
        trees = [s for s in self.shapes if s.kind != "none"]
        if not trees or any(s.kind not in self.KINDS for s in trees):
            raise ValueError(f"oracle drafter: {', '.join(map(str, self.shapes))} must be chain or static trees "
                             "(and optionally none)")
        if not 0 <= correct_depth < min(s.max_depth for s in trees):
            raise ValueError(f"oracle drafter: correct_depth {correct_depth} must be below every tree's depth "
                             f"({', '.join(map(str, trees))}): a wrong level must follow the right ones")
        if vocab_size < 2:
            raise ValueError(f"oracle drafter: vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.k = int(correct_depth)
        self.rates = None
        if accept_rates is not None:
            rates = [float(r) for r in accept_rates]
            if (not 1 <= len(rates) <= self.k or any(not 0.0 <= r <= 1.0 for r in rates)
                    or any(b > a for a, b in zip(rates, rates[1:]))):
                raise ValueError(f"oracle drafter: accept_rates must be 1 to correct_depth ({self.k}) non-increasing "
                                 f"chances in [0, 1], got {rates}")
            self.rates = torch.tensor(rates, device=device)
        self.device = torch.device(device)
        self.continuations: dict[tuple, list[int]] = {}
        self.seq: Optional[torch.Tensor] = None  # [B, W] root token then the continuation, -1 past its end
        self.pos: Optional[torch.Tensor] = None  # [B] index in ``seq`` of each slot's current root
        self._layouts: dict = {}

    def _layout(self, shape: TreeShape, batch: int):
        """Per node of ``shape``: depth, whether it carries a right token, a wrong-making offset; parents ``[B, N]``."""
        if shape not in self._layouts:
            depth = torch.tensor(shape.depths(), device=self.device)
            starts = torch.tensor(shape.level_starts(), device=self.device)
            nodes = torch.arange(shape.num_nodes, device=self.device)
            first = (nodes == starts[depth]) & (depth >= 1)  # first node of a level 1..
            right = first if self.rates is not None else first & (depth <= self.k)  # rows draw k, or k fixed here
            salt = wrong_salts(shape.num_nodes, self.vocab_size, self.device)
            parents = torch.tensor(shape.static_parents(), device=self.device).expand(batch, -1).contiguous()
            self._layouts[shape] = (depth, right, salt, parents)
        return self._layouts[shape]

    # ----- the Drafter side ------------------------------------------------------------------------
    def set_continuation(self, prompt_ids: Sequence[int], continuation: Sequence[int]) -> None:
        self.continuations[tuple(int(t) for t in prompt_ids[:-1])] = [int(prompt_ids[-1])] + [int(t) for t in continuation]

    def continuation(self, prompt_ids: Sequence[int]) -> list[int]:
        """The continuation registered for ``prompt_ids``; a ValueError when there is none."""
        seq = self.continuations.get(tuple(int(t) for t in prompt_ids[:-1]))
        if seq is None or seq[0] != int(prompt_ids[-1]):
            raise ValueError("oracle drafter: no continuation registered for this prompt")
        return seq[1:]

    def open(self, prompt_ids: Sequence[int], params: SamplingParams):
        """The host oracle's session on the registered continuation (the engine's host-drafter path)."""
        nodes = max(s.num_nodes for s in self.shapes)
        return OracleDrafter(prompt_ids, self.continuation(prompt_ids), self.vocab_size, self.k,
                             nodes).open(prompt_ids, params)

    def device_drafter(self) -> DeviceOffer:
        """Itself, over its shapes (several, ``none`` included, let the engine choose by goodput)."""
        return DeviceOffer(self, list(self.shapes))

    # ----- the DeviceDrafter side -------------------------------------------------------------------
    def supports(self, shape: TreeShape) -> bool:
        return shape in self.shapes

    def new_slots(self, batch_size: int, max_seqlen: int, device=None) -> None:
        depth = max(s.max_depth for s in self.shapes)
        self.seq = torch.full((batch_size, max_seqlen + depth + 1), -1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._layouts = {}

    def mutable(self) -> list[torch.Tensor]:
        return [self.pos]

    def prefill_slot(self, slot: int, context: torch.Tensor) -> None:
        """Load the slot's continuation (looked up by its context; between steps, so host work is fine)."""
        seq = self.continuations.get(tuple(context.tolist()), [])[: self.seq.shape[1]]
        self.seq[slot].fill_(-1)
        if seq:
            self.seq[slot, : len(seq)] = torch.tensor(seq, device=self.device)
        self.pos[slot] = 0

    def prefill_slots(self, slots: list[int], contexts: list) -> None:
        self.prefill_each(slots, contexts)

    def park(self, idle: torch.Tensor) -> None:
        self.pos.masked_fill_(idle, 0)

    def commit(self, path: torch.Tensor, path_len: torch.Tensor) -> None:
        self.pos += path_len

    def step_roots(self, roots: torch.Tensor) -> None:
        self.pos += 1

    def right_levels(self, sampling: RowSampling) -> torch.Tensor:
        """``[B, 1]``: how many levels of each row's draft are right, drawn from ``accept_rates`` (keyed by each
        row's request seed and step, as every draw in a step is)."""
        u = ops.keyed_uniform(sampling.seed, sampling.step, DRAFT_LANE, 1)
        return (u < self.rates[None, :]).sum(1, keepdim=True)

    def draft(self, shape: TreeShape, roots: torch.Tensor, sampling: RowSampling, any_sampled: bool) -> DeviceDraft:
        """Right tokens on the first node of levels 1..k (k fixed, or drawn per row), a certainly-wrong token
        everywhere else."""
        depth, right_nodes, salt, parents = self._layout(shape, roots.shape[0])
        is_right = right_nodes[None, :]
        if self.rates is not None:
            is_right = is_right & (depth[None, :] <= self.right_levels(sampling))
        idx = (self.pos[:, None] + depth[None, :]).clamp(max=self.seq.shape[1] - 1)
        right = torch.gather(self.seq, 1, idx).clamp(min=0)  # [B, N] the continuation token at each depth
        wrong = (right + salt[None, :]) % self.vocab_size
        tokens = torch.where(is_right, right, wrong)
        tokens[:, 0] = roots
        return DeviceDraft(tokens, parents, None, DraftMode.DETERMINISTIC)
