"""The batched speculative engine: B sequence slots, one device-resident step for all of them.

A step is draft -> target tree pass -> verification -> both commits, as tensor code over
``[slots, nodes]`` with fixed shapes per tree shape, so on CUDA it is one graph replay per step
(captured once per shape and sampling mode). The host reads back only the emitted tokens and
their counts, asynchronously: step k+1 is launched before step k's tokens are read, so the host's
bookkeeping overlaps the GPU. Sequences join (prefill into a free slot) and leave (stop token,
token limit, cancel) between steps. Host drafters (n-gram, retrieval, remote, plugins) hand in
TokenTrees that are padded into a fixed node bucket and copied to the device once per step.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.profiler import record_function

from stree.kernels.cuda_graph import capture_graph, replay_ms
from stree.protocols.device_drafter import DeviceDrafter
from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget, DrafterSession
from stree.protocols.sampling import RowSampling, SamplingParams
from stree.protocols.token_tree import DraftMode, TreeBatch, ancestor_mask
from stree.protocols.tree_shape import TreeShape
from stree.protocols.validate import tree_problem
from stree.verifier.decode.admission import AdmissionCosts, check_hold_steps, should_hold, steps_to_finish
from stree.verifier.decode.goodput import GoodputController
from stree.verifier.decode.drain import SlowestPrior, draft_finishes_later, sequence_taus
from stree.verifier.decode.verify_device import verify_batch
from stree.verifier.model.batch_prefill import next_power_of_two, prefill_buckets
from stree.verifier.model.graphed_prefill import PrefillRunner
from stree.verifier.model.lm import StreeLM

log = logging.getLogger(__name__)

PLAIN = TreeShape.parse("none")
EXPLORE_BUDGET = 0.02
"""Goodput control's first looks and retries may lose at most this fraction of the time against the best shape (see
goodput.py). 1 % kept auto on plain decoding at batch 1 of the trained pair after one unlucky first look (1.00-1.02x
plain where chain:1 is 1.19x) and still let a batch-4 run lose 4 % (H200, BENCHMARKS.md §0u)."""
EXPLORE_WINDOW = 1024
"""Steps over which that fraction is counted: older steps fade, so a budget saved through a quiet stretch is not
spent in one short run (goodput.py)."""
ADMIT_HOLD_STEPS = 32
"""At most this many steps free slots stay empty while more prompts wait than fit and a running sequence is about to
finish, so that queued prompts share one prefill (admission.py: the measured costs set the hold below this cap)."""
CATCH_UP = 16
"""Plain steps a model drafter may fall behind before the engine feeds it the backlog in one pass; past
that, the drafter's slots go stale and are prefilled afresh from the sequence before its next draft."""
REFRESH_PROBE_TOKENS = 256
"""Context length of the drafter refresh ``warm_up`` times: goodput control's first guess of what a refresh costs."""


def take_until_stop(tokens: Sequence[int], room: int, stop_token_ids) -> tuple[list[int], bool]:
    """The first ``room`` of ``tokens``, cut after the first stop token; and whether a stop token ended it."""
    out = []
    for tok in tokens[:room]:
        out.append(tok)
        if tok in stop_token_ids:
            return out, True
    return out, False


@dataclass
class Request:
    """One generation in the engine: its prompt and limits, and what it has emitted so far."""

    prompt_ids: list[int]
    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset = frozenset()
    request_id: object = None
    drafter_session: Optional[DrafterSession] = None  # host drafters only
    on_tokens: Optional[Callable[["Request", list[int]], None]] = None
    output: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draft_steps: int = 0  # steps that drafted for it (its own acceptance: verifier/decode/drain.py)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafter_fallbacks: int = 0
    host_drafted: int = 0  # nodes below the root in this step's host tree
    root_token: int = -1  # the last chosen token, not yet fed (host drafters' tree roots)
    prefill_s: float = 0.0
    submitted_s: float = field(default_factory=time.perf_counter)
    first_token_s: Optional[float] = None
    finished_s: Optional[float] = None
    admitted: bool = False  # took a slot (the engine closes its drafter session on leaving)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Ask the engine to drop this request at the next step boundary (its slot is freed)."""
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def _emit(self, tokens: list[int]) -> list[int]:
        """Append up to the limit or through a stop token; returns what was appended."""
        out, stopped = take_until_stop(tokens, self.max_new_tokens - len(self.output), self.stop_token_ids)
        if stopped:
            self.finish_reason = "stop"
        self.output.extend(out)
        if tokens:
            self.root_token = tokens[-1]
        if self.finish_reason is None and len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"
        if out and self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        if self.done:
            self.finished_s = time.perf_counter()
        return out

    @property
    def stats(self) -> dict:
        end = self.finished_s or time.perf_counter()
        elapsed = end - self.submitted_s
        n = len(self.output)
        return {
            "steps": self.steps,
            "new_tokens": n,
            "mean_accepted_length": n / self.steps if self.steps else 0.0,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "prefill_s": self.prefill_s,
            "time_to_first_token_s": (self.first_token_s - self.submitted_s) if self.first_token_s else None,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "drafter_fallbacks": self.drafter_fallbacks,
            "finish_reason": self.finish_reason,
        }


@dataclass
class _Launched:
    """A step whose outputs are still on their way to the host."""

    shape: TreeShape
    slots: list  # the request in each slot when the step was launched (None: idle)
    event: object
    out: torch.Tensor  # host copy of the step's output (pinned on CUDA): per row its tokens, then their count
    host_s: float
    drafted: int
    timer: tuple  # (start, end) CUDA events, or the step's wall seconds on the CPU
    measured: bool = True  # False when the step also captured a graph: its time is no cost sample
    refresh_s: float = 0.0  # the drafter refresh this step needed first (wall seconds): part of its cost
    refreshed: int = 0  # sequences that refresh prefilled
    sampled: bool = False  # some row sampled (goodput statistics are kept per sampling mode)


class Engine:
    """B slots of target state (and of a device drafter's state), stepped together.

    ``drafter`` is None (plain decoding), a ``DeviceDrafter`` (its whole draft runs in the step
    graph), or ``"host"``, in which case each request brings its own ``drafter_session``.
    ``shapes``: the tree shapes to choose from each step (``goodput=True`` picks the one with the
    best expected tokens per second, plain decoding included); the first is used otherwise.
    """

    def __init__(self, model: StreeLM, drafter=None, shapes: Sequence[TreeShape | str] = (),
                 max_batch: int = 8, max_seqlen: int = 4096, cuda_graphs: Optional[bool] = None,
                 goodput: bool = False, budget: DraftBudget = DEFAULT_BUDGET, seed: Optional[int] = None,
                 overlap: bool = True, prefill_chunk: int = 512, admit_hold_steps: int = ADMIT_HOLD_STEPS):
        self.model = model
        self.admit_hold_steps = check_hold_steps(admit_hold_steps)
        self._held = 0  # steps the free slots have waited so far
        self.admission_costs = AdmissionCosts()
        self.refresh_guess_s: Optional[float] = None  # a drafter refresh timed by warm_up (else admissions guess)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.device = model.device
        self.batch = int(max_batch)
        if self.batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.host = drafter == "host"
        self.drafter: Optional[DeviceDrafter] = None if (drafter is None or self.host) else drafter
        # a drafter that reads the target's final-norm hidden state at the last accepted node (TreeFlash)
        self.observes = self.drafter is not None and hasattr(self.drafter, "observe_target")
        # a drafter that can skip plain steps and catch up on their tokens in one pass before its next draft
        self.lazy = self.drafter is not None and hasattr(self.drafter, "catch_up")
        self.behind = 0  # plain steps since the drafter last caught up (host count; an upper bound per slot)
        # slots whose (lazy) drafter holds nothing useful: prefilled from prompt + output before the next draft
        # (idle slots count as stale, so ``False in stale`` asks whether some running slot's drafter is live)
        self.stale = [True] * int(max_batch)
        self.budget = budget
        self.shapes = self._shapes(shapes)
        self.max_nodes = max(s.num_nodes for s in self.shapes)
        if self.host:
            self.max_nodes = max(self.max_nodes, budget.max_nodes)
        # every step writes up to max_nodes KV rows past a slot's length; one extra step runs after a finish
        self.max_seqlen = int(max_seqlen) + 2 * (self.max_nodes + 1) + CATCH_UP
        self.cuda = self.device.type == "cuda"
        self.cuda_graphs = self.cuda if cuda_graphs is None else (bool(cuda_graphs) and self.cuda)
        self.overlap = overlap and self.cuda
        self.step_costs: dict = {}  # step graph key -> seconds per replay, timed at capture (goodput priors)
        self.tau_prior: dict = {}  # (sampled, shape) -> (tau, retry_every) learned earlier (another engine, before warm_up)
        self.depth_prior: dict = {}  # sampled -> DepthAcceptance of chain drafts learned earlier (likewise)
        goodput = bool(goodput) and len(self.shapes) > 1  # one shape leaves nothing to choose
        # with goodput control a lazy drafter is prefilled only when a draft is chosen, not at admission
        self.defer_drafter = self.lazy and goodput
        self.goodput = self._goodput() if goodput else None
        # CUDA: the device's default generator, which graph replays advance safely; CPU: our own
        self.generator = None if self.cuda else torch.Generator()
        self.reseed(seed)
        if self.drafter is not None:  # its slots are allocated for this engine: an engine built later takes them over
            self.drafter._stree_engine = weakref.ref(self)
        self._allocate()
        self.slots: list[Optional[Request]] = [None] * self.batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.pending: collections.deque[_Launched] = collections.deque()
        self.graphs: dict = {}
        self.graphs_failed = False
        self.metrics = collections.Counter()
        self._metric_names: dict = {}
        self.step_host_s: list[float] = []
        self.slow_prior = SlowestPrior()  # how slow the slowest sequence of a batch tends to be (draining batches)
        self.forced_shapes: Optional[list] = None  # warm_up cycles through these instead of choosing
        self.warmed_up = False  # warm_up captured every step graph (warm_up_engines then leaves the engine alone)
        self._forced_at = 0

    def _goodput(self) -> GoodputController:
        """A fresh controller, started from the step costs timed so far and the acceptance known from before."""
        ctl = GoodputController(self.shapes, explore_budget=EXPLORE_BUDGET, explore_window=EXPLORE_WINDOW)
        self._prime_learned(ctl)
        self._guess_refresh(ctl)
        for key, seconds in self.step_costs.items():
            self._prime_cost(ctl, key, seconds)
        return ctl

    def _guess_refresh(self, ctl: GoodputController) -> None:
        """Until ``ctl`` measures a drafter refresh, it takes refreshing one sequence to cost the one-slot refresh
        ``warm_up`` timed, else an admission (a prefill of the target too: an overestimate that delayed auto's
        first drafts by hundreds of steps on the H100, BENCHMARKS.md §0p). A drafter that is never deferred follows
        every step and is never refreshed: nothing (an admission's guess kept auto on plain decoding through whole
        128-token runs of the 2.7B oracle, whose drafts were free and right to depth 3, §0r)."""
        if not self.defer_drafter:
            ctl.guess_refresh(0.0)
            return
        guess = self.refresh_guess_s if self.refresh_guess_s is not None else self.admission_costs.admit_s
        if guess is not None:
            ctl.guess_refresh(guess)

    def _time_refresh(self) -> float:
        """Wall seconds of one drafter refresh of a ``REFRESH_PROBE_TOKENS``-token context into slot 0 (the second
        of two runs: the first may compile); the slot is free, and is prefilled again when a sequence joins it."""
        context = [0] * max(1, min(REFRESH_PROBE_TOKENS, self.max_seqlen // 2))
        seconds = 0.0
        for _ in range(2):
            if self.cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.drafter.prefill_slots([0], [context])
            if self.cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        self.stale[0] = True
        return seconds

    @staticmethod
    def _prime_cost(ctl: GoodputController, key, seconds: float) -> None:
        """Tell ``ctl`` what the step graph ``key`` costs per replay (plain and device-drafted steps only)."""
        if key[0] == "none":
            ctl.prime(PLAIN, key[1], cost=seconds)
        elif key[0] == "tree":
            ctl.prime(key[1], key[2], cost=seconds)

    def inherit_acceptance(self, other: "Engine") -> None:
        """Start goodput control from the acceptance ``other`` (an engine over the same drafter) measured:
        it belongs to the drafter and the traffic, not to the batch size, so a new engine need not relearn it."""
        if self.goodput is None or other.goodput is None:
            return
        self.tau_prior.update(other.tau_prior)
        self.depth_prior.update(other.depth_prior)
        self.slow_prior.extend(other.slow_prior)
        self._remember(other.goodput)
        self._prime_learned(self.goodput)
        if self.refresh_guess_s is None and other.refresh_guess_s is not None:  # the same drafter's refresh
            self.refresh_guess_s = other.refresh_guess_s
            self._guess_refresh(self.goodput)

    def _remember(self, ctl: GoodputController) -> None:
        """Keep what ``ctl`` learned (tau and back-off per shape, per-depth chain acceptance) for controllers made later."""
        self.tau_prior.update(ctl.learned())
        self.depth_prior.update(ctl.learned_depths())

    def _prime_learned(self, ctl: GoodputController) -> None:
        """Prime ``ctl`` with the tau, retry back-off and per-depth chain acceptance learned before."""
        for (sampled, shape), (tau, retry_every) in self.tau_prior.items():
            ctl.prime(shape, sampled, tau=tau, retry_every=retry_every)
        ctl.prime_depths(self.depth_prior)

    def reseed(self, seed: Optional[int]) -> None:
        """Seed the draws of sampled rows (verification uniforms, Gumbel noise); None: a fresh random seed.

        A seeded run is reproducible for the same prompts in the same batch order.
        """
        seed = int(torch.randint(0, 2**62, (1,))) if seed is None else int(seed)
        if self.cuda:
            torch.cuda.manual_seed(seed)
        else:
            self.generator.manual_seed(seed)
        if self.drafter is not None:
            self.drafter.generator = self.generator

    # ----- set-up -------------------------------------------------------------------------------
    def _shapes(self, shapes) -> list[TreeShape]:
        out = [s if isinstance(s, TreeShape) else TreeShape.parse(s) for s in shapes] or [PLAIN]
        for s in out:
            if s.kind == "dynamic":
                raise ValueError("dynamic trees have no fixed layout: use a host drafter for them")
            if s.kind != "none" and self.drafter is not None and not self.drafter.supports(s):
                raise ValueError(f"the drafter cannot lay out {s} trees")
            if s.kind != "none" and self.drafter is None and not self.host:
                raise ValueError(f"tree {s} needs a drafter")
        if self.host:
            out = [TreeShape.parse("none"), TreeShape("host", nodes=_bucket(self.budget.max_nodes))]
        return list(dict.fromkeys(out))

    def _allocate(self) -> None:
        b, dev = self.batch, self.device
        self.state = self.model.new_state(b, self.max_seqlen)
        self.prefiller = PrefillRunner(self.model, b, self.max_seqlen, self.prefill_chunk, cuda_graphs=self.cuda_graphs)
        if self.drafter is not None:
            self.drafter.new_slots(b, self.max_seqlen)
        self.roots = torch.zeros(b, dtype=torch.long, device=dev)
        self.idle = torch.ones(b, dtype=torch.bool, device=dev)
        self.sampling = RowSampling.greedy(b, dev)
        width = max(self.max_nodes, self.budget.max_depth, *(s.max_depth for s in self.shapes if s.kind != "host"))
        # a step's whole output, tokens then their count, in one buffer: one device-to-host copy per step
        self.out = torch.zeros(b, width + 2, dtype=torch.long, device=dev)
        self.out_tokens, self.out_counts = self.out[:, : width + 1], self.out[:, width + 1]
        # pinned host copies, reused in turn (at most two steps are ever in flight)
        self._host_out = [torch.empty(self.out.shape, dtype=torch.long, pin_memory=self.cuda) for _ in range(3)]
        self._host_turn = 0
        # per turn: the step's start and end (timed) and its copy's arrival
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                         torch.cuda.Event()) for _ in self._host_out] if self.cuda else []
        # host trees arrive here: tokens, parents, depth, valid as one packed [4, B, N] copy
        self.host_trees = torch.zeros(4, b, self.max_nodes, dtype=torch.long, device=dev)
        # tokens the plain steps fed the target but not the (lazy) drafter, and how many per slot
        self.backlog = torch.zeros(b, CATCH_UP, dtype=torch.long, device=dev)
        self.backlog_len = torch.zeros(b, dtype=torch.long, device=dev)
        self.host_q = None
        self._layouts: dict = {}

    def _layout(self, shape: TreeShape):
        """Depths, node counts and an all-valid mask of a fixed layout, as device constants."""
        if shape not in self._layouts:
            b, n, dev = self.batch, shape.num_nodes, self.device
            depth = torch.tensor(shape.depths(), device=dev).expand(b, n).contiguous()
            count = torch.full((b,), n, dtype=torch.long, device=dev)
            self._layouts[shape] = (depth, count, torch.ones(b, n, dtype=torch.bool, device=dev))
        return self._layouts[shape]

    def _ancestors(self, shape: TreeShape) -> Optional[torch.Tensor]:
        """The tree attention mask of a layout whose parents never change (chain, static), made once: the
        target's tree pass would otherwise rebuild it every step (a dozen small launches). None for beams."""
        if shape.kind not in ("chain", "static"):
            return None
        key = ("ancestors", shape)
        if key not in self._layouts:
            parents = torch.tensor(shape.static_parents(), device=self.device)
            self._layouts[key] = ancestor_mask(parents.expand(self.batch, -1).contiguous())
        return self._layouts[key]

    # ----- requests -----------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        """Queue a request; it joins a free slot at the next step boundary."""
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if min(prompt) < 0 or max(prompt) >= self.model.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.model.vocab_size})")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        room = self.max_seqlen - 2 * (self.max_nodes + 1)
        if len(prompt) + request.max_new_tokens > room:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({request.max_new_tokens}) is over "
                             f"the engine's {room} tokens per sequence")
        if self.host and request.drafter_session is None:
            raise ValueError("a host-drafter engine needs each request's drafter_session")
        self.waiting.append(request)
        return request

    @property
    def owns_drafter(self) -> bool:
        """False once another engine was built over this engine's device drafter (its state is that engine's now)."""
        return self.drafter is None or getattr(self.drafter, "_stree_engine", lambda: None)() is self

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0 or bool(self.pending)

    def _hold_admission(self, free: int) -> bool:
        """Whether the free slots stay empty this step (``admission.should_hold`` under the measured costs' budget)."""
        budget = self.admission_costs.hold_steps(free, self.batch, self.admit_hold_steps)
        running = (steps_to_finish(r.max_new_tokens - len(r.output), len(r.output), r.steps)
                   for r in self.slots if r is not None and not r.done)
        return should_hold(len(self.waiting), free, self._held, budget, running)

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, all of them in a few batched passes (between steps).

        With a queue longer than the free slots, admission may wait a few steps (at most ``admit_hold_steps``) for
        running sequences about to finish, so that more prompts share one prefill (``admission.py``).
        """
        free = [i for i, r in enumerate(self.slots) if r is None]
        if not free or not self.waiting:
            self._held = 0
            return
        if self._hold_admission(len(free)):
            self._held += 1
            self.metrics["admission_holds"] += 1
            return
        self._held = 0
        joining: list[Request] = []
        while self.waiting and len(joining) < len(free):
            req = self.waiting.popleft()
            if not req.done:  # a request cancelled while waiting never takes a slot
                joining.append(req)
        if not joining:
            return
        t0 = time.perf_counter()
        hidden: dict = {}  # joining request j takes slot free[j]

        def deliver(index, first, hid):
            self.state.assign_rows([free[j] for j in index], self.prefiller.scratch.rows(len(index), first))
            if self.observes:
                for k, j in enumerate(index):
                    hidden[j] = hid[k].clone()

        if not self.prefiller.run([r.prompt_ids[:-1] for r in joining], deliver,
                                  keep_going=lambda: any(not r.done for r in joining)):
            return  # every one of them was cancelled during the prefill: the slots stay free
        picked = [j for j, r in enumerate(joining) if not r.done]  # cancelled mid-prefill: dropped
        slots = [free[j] for j in picked]
        admitted = [joining[j] for j in picked]
        if self.drafter is not None and not self.defer_drafter:
            self.drafter.prefill_slots(slots, [r.prompt_ids[:-1] for r in admitted])
            self.backlog_len[slots] = 0
        elapsed = time.perf_counter() - t0
        self.metrics["admit_s"] += elapsed
        self.admission_costs.observe_admit(elapsed)
        if self.goodput is not None:
            self._guess_refresh(self.goodput)
        for j, i, req in zip(picked, slots, admitted):
            if self.observes:
                self.drafter.observe_target(hidden[j], slot=i)
            self.stale[i] = self.defer_drafter
            self.roots[i] = req.prompt_ids[-1]
            req.root_token = req.prompt_ids[-1]
            self.sampling.set_row(i, req.params)
            self.slots[i] = req
            req.admitted = True
            req.prefill_s = elapsed
        self._sync_idle()

    def _release(self, i: int) -> None:
        req = self.slots[i]
        if req is not None and req.draft_steps and self.goodput is not None:
            self.slow_prior.record(req.num_accepted_draft_tokens, req.draft_steps)
        self.slots[i] = None
        self.stale[i] = True
        if req is not None and req.drafter_session is not None:
            try:
                req.drafter_session.close()
            except Exception as exc:  # noqa: BLE001 - a plugin's close must not stop the engine
                log.warning("drafter close failed: %r", exc)

    def _sync_idle(self) -> None:
        self.idle.copy_(torch.tensor([r is None for r in self.slots], device=self.device))

    # ----- the step (device code) -----------------------------------------------------------------
    def _verify_commit(self, tokens, parents, depth, count, valid, q, mode, max_depth: int, max_width: int,
                       any_sampled: bool, is_chain: bool = False, anc: Optional[torch.Tensor] = None):
        trees = TreeBatch(tokens, parents, depth, count, is_chain)
        with record_function("stree.target_tree_pass"):
            logits, acts, hidden = self.model.tree_forward(trees, self.state, anc_mask=anc, return_hidden=True)
        with record_function("stree.verify"):
            res = self._verify(tokens, parents, valid, logits, mode, q, max_depth, max_width, any_sampled)
        with record_function("stree.target_commit"):
            self.model.commit(self.state, acts, res.path, res.path_len)
        if self.observes:  # the hidden state after the last accepted node (it chose the bonus token)
            last = res.path.gather(1, (res.path_len - 1)[:, None])
            self.drafter.observe_target(hidden.gather(1, last[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0])
        return res

    def _verify(self, tokens, parents, valid, logits, mode, q, max_depth, max_width, any_sampled):
        n = tokens.shape[1]
        u = (torch.rand(2, self.batch, n, device=self.device, generator=self.generator) if any_sampled
             else torch.zeros(2, self.batch, n, device=self.device))
        return verify_batch(tokens, parents, valid, logits, self.sampling.temperature, *self.sampling.filters(),
                            mode, q, u[0], u[1], max_depth=max_depth, max_width=max_width, sampling=any_sampled)

    def _finish_step(self, res, park: bool = True, backlog: bool = True) -> None:
        """Publish the step's tokens and next roots; rewind idle slots (the drafter's with ``park``, their
        backlog with ``backlog``: a plain step that moved neither skips those launches)."""
        width = res.out_tokens.shape[1]
        self.out_tokens[:, :width].copy_(res.out_tokens)
        self.out_counts.copy_(res.num_out)
        self.roots.copy_(res.bonus)
        self.state.seqlen.masked_fill_(self.idle, 0)
        if self.drafter is not None:
            if park:
                self.drafter.park(self.idle)
            if backlog and self.lazy:
                self.backlog_len.masked_fill_(self.idle, 0)

    def _plain_step(self, any_sampled: bool, feed: bool):
        logits, hidden = self.model.step(self.roots, self.state, return_hidden=True)
        if self.lazy:  # fed these tokens later, all at once (catch_up), or refreshed when it went stale
            if feed:
                self.backlog.scatter_(1, self.backlog_len.clamp(max=CATCH_UP - 1)[:, None], self.roots[:, None])
                self.backlog_len += 1
        elif self.drafter is not None:
            self.drafter.step_roots(self.roots)
            if self.observes:
                self.drafter.observe_target(hidden)
        depth, count, valid = self._layout(PLAIN)
        res = self._verify(self.roots[:, None], torch.full_like(depth, -1), valid, logits[:, None],
                           DraftMode.DETERMINISTIC, None, 0, 1, any_sampled)
        # a lazy drafter did not move in this step, and its backlog only if fed
        self._finish_step(res, park=not self.lazy, backlog=feed)

    def _device_step(self, shape: TreeShape, any_sampled: bool):
        with record_function("stree.draft"):
            draft = self.drafter.draft(shape, self.roots, self.sampling, any_sampled)
        depth, count, valid = self._layout(shape)
        res = self._verify_commit(draft.tokens, draft.parents, depth, count, valid,
                                  draft.q if any_sampled else None, draft.mode if any_sampled else
                                  DraftMode.DETERMINISTIC, shape.max_depth, shape.max_width, any_sampled,
                                  shape.is_chain, self._ancestors(shape))
        with record_function("stree.draft_commit"):
            self.drafter.commit(res.path, res.path_len)
        self._finish_step(res)

    def _host_step(self, shape: TreeShape, mode: DraftMode, with_q: bool, any_sampled: bool):
        tokens, parents, depth, valid = self.host_trees[:, :, : shape.nodes]
        count = valid.sum(-1)
        q = self.host_q if with_q else None
        res = self._verify_commit(tokens, parents, depth, count, valid.bool(), q, mode,
                                  self.budget.max_depth, self.budget.max_width, any_sampled)
        self._finish_step(res)

    def _run(self, key) -> None:
        """Run the step ``key`` names, replaying its CUDA graph when graphs are on."""
        fn = self._step_fn(key)
        if not self.cuda_graphs or self.graphs_failed:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(fn, key)
            except Exception as exc:  # noqa: BLE001 - a capture failure costs speed, never output
                log.warning("step graph capture failed (%r); running eagerly from now on", exc, exc_info=True)
                self.graphs_failed = True
                fn()
                return
            self.graphs[key] = graph
            if self.goodput is not None:
                self._prime_cost(self.goodput, key, self.step_costs[key])
        graph.replay()

    def _catch_up(self) -> None:
        self.drafter.catch_up(self.backlog, self.backlog_len)
        self.backlog_len.zero_()

    def _step_fn(self, key):
        kind = key[0]
        if kind == "catch_up":
            return self._catch_up
        if kind == "none":
            return lambda: self._plain_step(key[1], key[3])
        if kind == "host":
            return lambda: self._host_step(key[1], key[2], key[3], key[4])
        return lambda: self._device_step(key[1], key[2])

    def _capture(self, fn, key=None):
        """Capture ``fn`` as a graph and time a few replays of it (``step_costs``, goodput control's step cost
        before the shape's first step), then restore every state the warm-up runs and replays advanced."""
        saved = [t.clone() for t in self._mutable()]
        rng = torch.cuda.get_rng_state(self.device)  # the warm-up runs draw samples: a seeded run must not see them
        try:
            graph, _ = capture_graph(fn, warmup=2)
            if key is not None:
                self.step_costs[key] = statistics.median(replay_ms(graph, 3)) / 1e3
        finally:  # also when the capture fails: the eager fallback must start from the same state
            for t, s in zip(self._mutable(), saved):
                t.copy_(s)
            torch.cuda.set_rng_state(rng, self.device)
        return graph

    def _mutable(self) -> list[torch.Tensor]:
        tensors = [self.roots, self.state.seqlen, self.out, self.backlog, self.backlog_len]
        for layer in self.state.layers:
            tensors += list(vars(layer).values())
        if self.drafter is not None:
            tensors += self.drafter.mutable() if hasattr(self.drafter, "mutable") else self._drafter_state()
        return tensors

    def _drafter_state(self) -> list[torch.Tensor]:
        """A draft model's slot state: what a step graph's warm-up runs advance."""
        tensors = [self.drafter.state.seqlen]
        for layer in self.drafter.state.layers:
            tensors += list(vars(layer).values())
        return tensors

    # ----- one engine step (host side) ------------------------------------------------------------
    def step(self) -> list[tuple[Request, list[int]]]:
        """Admit, launch one step for every slot, and emit what the previous step produced.

        Returns ``(request, new tokens)`` pairs; finished requests have left their slots.
        """
        t0 = time.perf_counter()
        if not self.owns_drafter:
            raise RuntimeError("another engine was built over this engine's device drafter and holds its state now; "
                               "give each engine its own drafter")
        self._drop_cancelled()
        self._admit()
        emitted: list = []
        if self.num_running:
            sampled = self._any_sampled()
            shape = self._choose(sampled)
            refresh_s, refreshed = 0.0, 0
            if shape.kind not in ("none", "host") and any(self.stale[i] for i in self._running()):
                emitted += self._drain()
                t1 = time.perf_counter()
                refreshed = self._refresh_drafter()
                refresh_s = time.perf_counter() - t1
                self.metrics["refresh_s"] += refresh_s
            if self.num_running:
                launched = self._launch(t0, shape, sampled)
                launched.refresh_s, launched.refreshed = refresh_s, refreshed
                self.pending.append(launched)
        while self.pending and (len(self.pending) > 1 or not self.overlap or not self.num_running
                                or self.host):
            emitted += self._collect(self.pending.popleft())
        return emitted

    def _running(self) -> list[int]:
        return [i for i, r in enumerate(self.slots) if r is not None]

    def _drain(self) -> list[tuple[Request, list[int]]]:
        """Collect every step in flight (a sync): the host then knows each sequence up to its root."""
        out = []
        while self.pending:
            out += self._collect(self.pending.popleft())
        return out

    def _refresh_drafter(self) -> int:
        """Prefill the stale drafter slots from their whole sequence before the root (prompt + output); returns how
        many.

        Cheaper than keeping a drafter in step through long runs of plain steps that goodput control
        chose: it is paid only when a draft is chosen again. Needs every step collected (``_drain``).
        """
        slots = [i for i in self._running() if self.stale[i]]
        self.drafter.prefill_slots(slots, [(self.slots[i].prompt_ids + self.slots[i].output)[:-1] for i in slots])
        for i in slots:
            self.stale[i] = False
        self.backlog_len[slots] = 0
        self.metrics["drafter_refreshes"] += len(slots)
        return len(slots)

    def _drop_cancelled(self) -> None:
        freed = False
        for i, req in enumerate(self.slots):
            if req is not None and req.done:
                self._release(i)
                freed = True
        if freed:
            self._sync_idle()

    def _any_sampled(self) -> bool:
        return any(r is not None and not r.params.greedy for r in self.slots)

    def _choose(self, sampled: bool = False) -> TreeShape:
        if self.forced_shapes is not None:
            self._forced_at += 1
            return self.forced_shapes[(self._forced_at - 1) % len(self.forced_shapes)]
        if self.host:
            return self.shapes[-1]
        if self.goodput is not None:
            shape = self.goodput.choose(sampled, self.num_running)
            if shape.kind != "none" and not self.waiting and self.num_running > 1 and self._drain_prefers_plain(
                    shape, sampled):
                self.metrics["drain_plain_steps"] += 1
                self.goodput.mode(sampled).ran_instead(PLAIN)
                return PLAIN
            return shape
        return self.shapes[0]

    def _drain_prefers_plain(self, shape: TreeShape, sampled: bool) -> bool:
        """With nothing waiting, whether plain decoding finishes the running set sooner than the draft ``shape``
        that goodput control chose on merit (``verifier/decode/drain.py``); retries and first looks run as chosen."""
        mode = self.goodput.mode(sampled)
        if shape != mode.current or PLAIN not in mode.stats:
            return False
        running = [r for r in self.slots if r is not None and not r.done]
        taus = sequence_taus(mode.stats[shape].tau, [r.num_accepted_draft_tokens for r in running],
                             [r.draft_steps for r in running], self.slow_prior.ratio(len(running)))
        remaining = [r.max_new_tokens - len(r.output) for r in running]
        return draft_finishes_later(remaining, taus, mode.stats[shape].cost, mode.stats[PLAIN].cost)

    def _launch(self, t0: float, shape: TreeShape, any_sampled: bool) -> _Launched:
        # sampled steps warp with or without the top-k/top-p sorts: one graph each (the last key element)
        filtered = any_sampled and self.sampling.filtered
        drafted = 0
        if shape.kind == "none" and self.lazy and self.behind >= CATCH_UP:
            # the backlog is full: rather than catch up now (a plain run may go on for long), let the
            # drafter go stale; it is prefilled afresh if and when a draft is chosen again
            for i in self._running():
                self.stale[i] = True
            self.backlog_len.zero_()
            self.behind = 0
        # plain steps feed the backlog while some running slot's drafter is live
        feed = self.lazy and False in self.stale
        if shape.kind == "none":
            key = ("none", any_sampled, filtered, feed)
        elif shape.kind == "host":
            shape, mode, with_q, drafted = self._stage_host_trees(any_sampled)
            key = ("host", shape, mode, with_q, any_sampled, filtered)
        else:
            key = ("tree", shape, any_sampled, filtered)
            drafted = shape.num_nodes - 1
        # a lazy drafter catches up on its backlog before it drafts
        catch_up = self.lazy and self.behind > 0 and shape.kind != "none"
        graphs_before = len(self.graphs)
        turn = self._host_turn
        self._host_turn = (turn + 1) % len(self._host_out)
        if self.cuda:
            start, end, event = self._events[turn]
            stream = torch.cuda.current_stream(self.device)  # looked up once: each lookup costs the host microseconds
            start.record(stream)
            self._run_step(key, catch_up)
            end.record(stream)
            timer = (start, end)
            host = self._host_out[turn]
            host.copy_(self.out, non_blocking=True)
            event.record(stream)
        else:
            t1 = time.perf_counter()
            self._run_step(key, catch_up)
            timer = (time.perf_counter() - t1,)
            host, event = self.out.clone(), None
        return _Launched(shape, list(self.slots), event, host, time.perf_counter() - t0, drafted, timer,
                         measured=len(self.graphs) == graphs_before,  # no graph was captured in it
                         sampled=any_sampled)

    def _run_step(self, key, catch_up: bool) -> None:
        if catch_up:
            self._run(("catch_up",))
            self.behind = 0
        self._run(key)
        if key[0] == "none" and key[3]:
            self.behind += 1

    def _collect(self, step: _Launched) -> list[tuple[Request, list[int]]]:
        t0 = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        t1 = time.perf_counter()
        rows = step.out.tolist()  # one host read: each row's tokens, then their count last
        out, accepted = [], []
        freed = False
        for i, req in enumerate(step.slots):
            if req is None or req.done:
                continue
            row = rows[i]
            new = row[: row[-1]]
            req.steps += 1
            drafted = step.drafted if step.shape.kind != "host" else req.host_drafted
            req.num_draft_tokens += drafted
            req.num_accepted_draft_tokens += len(new) - 1
            req.draft_steps += drafted > 0
            for pos in range(len(new) - 1):
                if pos == len(req.accepted_per_pos):
                    req.accepted_per_pos.append(0)
                req.accepted_per_pos[pos] += 1
            accepted.append(len(new))
            got = req._emit(new)
            if req.drafter_session is not None and not req.done:
                self._commit_host(req, new)
            if got:
                out.append((req, got))
                if req.on_tokens is not None:
                    req.on_tokens(req, got)
            if req.done and self.slots[i] is req:
                self._release(i)
                freed = True
        if freed:
            self._sync_idle()
        host_s = step.host_s + (time.perf_counter() - t1)
        self.step_host_s.append(host_s)
        self.metrics["steps"] += 1
        self.metrics["waited_s"] += t1 - t0
        seconds = step.timer[0] if len(step.timer) == 1 else step.timer[0].elapsed_time(step.timer[1]) / 1e3
        self.metrics["gpu_s"] += seconds
        steps_key, gpu_key = self._shape_metrics(step.shape)  # per shape: where a goodput run spends its time
        self.metrics[steps_key] += 1
        self.metrics[gpu_key] += seconds
        # a capture's warm-up runs and the capture itself are no sample of what the step costs: the
        # controller would otherwise shun the shape (plain decoding included) for retry_every steps
        # a step that first refreshed a stale drafter is charged part of it (GoodputController.observe)
        if step.measured:
            self.admission_costs.observe_step(seconds)
        if self.goodput is not None and accepted and step.drafted:
            self.slow_prior.observe([a - 1 for a in accepted])
        if self.goodput is not None and accepted and step.measured:
            self.goodput.observe(step.shape, sum(accepted) / len(accepted), seconds, step.refresh_s,
                                 refreshed=step.refreshed,
                                 sampled=step.sampled, emitted=accepted)
        return out

    def _shape_metrics(self, shape: TreeShape) -> tuple[str, str]:
        """The metric names of ``shape``'s step count and GPU seconds (formatted once per shape, not per step)."""
        names = self._metric_names.get(shape)
        if names is None:
            names = self._metric_names[shape] = (f"steps:{shape}", f"gpu_s:{shape}")
        return names

    # ----- host drafters ----------------------------------------------------------------------------
    def _stage_host_trees(self, any_sampled: bool):
        """Ask every slot's drafter session for a tree; pad them into one [4, B, N] copy to the device.

        N is the power of two that holds the largest tree this step (one graph per bucket).
        """
        trees, mode = [None] * self.batch, None
        total = 0
        for i, req in enumerate(self.slots):
            if req is None:
                continue
            tree = self._host_draft(req)
            if tree is not None and tree.num_nodes > 1 and mode is None:
                mode = tree.mode
            if tree is not None and tree.num_nodes > 1 and tree.mode is not mode:
                tree = None  # one verification rule per step; a tree of another kind waits its turn
            trees[i] = tree
        n = _bucket(max(t.num_nodes if t is not None else 1 for t in trees))
        shape = TreeShape("host", nodes=n)
        vocab = self.model.vocab_size
        packed = torch.zeros(4, self.batch, n, dtype=torch.long)
        packed[2] = 1  # padding nodes: children of the root, never valid
        # Greedy rows verify by argmax alone: a sampled tree's draft_probs play no part in them.
        mode = (mode if any_sampled else None) or DraftMode.DETERMINISTIC
        with_q = any_sampled and mode is not DraftMode.DETERMINISTIC
        q = torch.zeros(self.batch, n, vocab) if with_q else None
        for i, tree in enumerate(trees):
            req = self.slots[i]
            packed[0, i, 0] = req.root_token if req is not None else 0
            packed[1, i, 0] = -1
            packed[2, i, 0] = 0
            packed[3, i, 0] = 1
            if req is not None:
                req.host_drafted = 0
            if tree is None:
                continue
            m = tree.num_nodes
            packed[0, i, :m] = tree.tokens
            packed[1, i, :m] = tree.parents
            packed[2, i, :m] = tree.depth
            packed[3, i, :m] = 1
            req.host_drafted = m - 1
            total += m - 1
            if with_q and tree.draft_probs is not None:
                q[i, :m] = tree.draft_probs
        self.host_trees[:, :, :n].copy_(packed.to(self.device, non_blocking=False))
        if with_q:
            if self.host_q is None or self.host_q.shape != q.shape:
                self.host_q = torch.zeros(q.shape, device=self.device)
            self.host_q.copy_(q)
        return shape, mode, with_q, total

    def _host_draft(self, req: Request):
        """The session's tree for this step, or None (a plain step for this slot) when it is unusable."""
        budget = DraftBudget(min(self.budget.max_nodes, self.shapes[-1].nodes), self.budget.max_depth,
                             self.budget.max_width)
        try:
            tree = req.drafter_session.draft(budget)
            why = tree_problem(tree, req.root_token, budget, self.model.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a broken drafter costs speed, never output
            why = f"drafter failed: {exc!r}"
        if why is not None:
            req.drafter_fallbacks += 1
            if req.drafter_fallbacks <= 3 or req.drafter_fallbacks % 100 == 0:
                log.warning("drafter skipped for this step (%d so far): %s", req.drafter_fallbacks, why)
            return None
        return tree

    def _commit_host(self, req: Request, new: list[int]) -> None:
        try:
            req.drafter_session.commit(new)
        except Exception as exc:  # noqa: BLE001
            log.warning("drafter commit failed (%r); continuing without the drafter", exc)
            req.drafter_session = DeadSession()

    # ----- whole runs ---------------------------------------------------------------------------------
    def warm_up_prefill(self) -> None:
        """Prefill once at every (rows, width) bucket, target and draft model, so that no request waits on a
        kernel compile or a graph capture for its prompt length or its batch (a capture stalls the run it
        happens in for several passes). Only while the engine holds no sequence (the drafter's slots are
        scratch then)."""
        if self.has_work:
            return
        self.prefiller.warm_up()
        if hasattr(self.drafter, "prefiller"):
            self.drafter.prefiller.warm_up()
        elif self.drafter is not None:
            for width in prefill_buckets(self.prefill_chunk):
                self.drafter.prefill_slots([0], [[0] * width])

    def warm_up(self) -> int:
        """Capture every step graph now (greedy and sampled, each shape, the drafter's catch-up, plain steps
        with and without a live drafter to feed) with short throw-away generations, so that no request
        waits on a capture; returns the graphs held.

        Does nothing without CUDA graphs, or for host drafters (their trees come with each request).
        Goodput statistics start afresh afterwards (from the step costs timed at capture and the acceptance
        measured before the throw-away runs), and so do the step metrics.
        """
        if self.cuda:
            self.warm_up_prefill()
        if not self.cuda_graphs or self.host or self.has_work:
            return len(self.graphs)
        if self.goodput is not None:  # what the engine measured before (real traffic) outlives the throw-away runs
            self._remember(self.goodput)
        trees = [s for s in self.shapes if s.kind != "none"]
        # per tree shape: plain (drafter stale or deferred), draft, plain feeding the drafter, catch-up + draft
        patterns = [[PLAIN, s, PLAIN, s] for s in trees] if trees else [[PLAIN]]
        try:
            for params in (SamplingParams(), SamplingParams(temperature=1.0)):
                for pattern in patterns:
                    self.forced_shapes, self._forced_at = pattern, 0
                    steps = len(pattern) * (max(s.max_depth for s in pattern) + 1)
                    self.run([Request([0, 0], max_new_tokens=steps, params=params)])
        finally:
            self.forced_shapes = None
        self.warmed_up = True
        if self.goodput is not None:
            if self.defer_drafter:  # refreshes are what leaving plain decoding costs: time one now
                self.refresh_guess_s = self._time_refresh()
            self.goodput = self._goodput()
        self.metrics.clear()
        self.step_host_s.clear()
        return len(self.graphs)

    def run(self, requests: Sequence[Request]) -> list[Request]:
        """Add ``requests`` and step until all of them are done."""
        for r in requests:
            self.add(r)
        while self.has_work:
            self.step()
        return list(requests)

    @property
    def host_step_stats(self) -> dict:
        """Host time per step (launch + bookkeeping, excluding waits for the GPU), in microseconds."""
        xs = sorted(self.step_host_s)
        if not xs:
            return {}
        return {"host_us_p50": 1e6 * xs[len(xs) // 2], "host_us_mean": 1e6 * sum(xs) / len(xs),
                "host_us_p90": 1e6 * xs[int(0.9 * (len(xs) - 1))]}


class DeadSession:
    """Stands in for a host drafter that failed for good: always the empty draft."""

    def draft(self, budget):
        raise RuntimeError("drafter is gone")

    def commit(self, tokens):
        return None

    def close(self):
        return None


def _bucket(n: int) -> int:
    """Host trees are padded to a power of two nodes (few graphs, little padding)."""
    return next_power_of_two(n)
