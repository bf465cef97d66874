"""The decoding loop: prefill -> { draft -> tree forward -> verify -> commit } until done.

``DecodeSession`` runs one generation step by step (the server streams from it); ``generate`` is
the one-call Python API. A drafter that raises or hands back an invalid or over-budget tree is
replaced by the root-only tree for that step, which is a plain decoding step: output never changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget, Drafter, DrafterSession
from stree.protocols.registry import create_drafter
from stree.protocols.sampling import SamplingParams, warp_logits
from stree.protocols.token_tree import DraftMode, TokenTree, TreeBatch
from stree.protocols.validate import tree_problem

from stree.verifier.decode.admission import check_hold_steps
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS, DeadSession, Engine, Request, take_until_stop
from stree.verifier.model.lm import StreeLM
from stree.verifier.decode.verify import verify_tree

log = logging.getLogger(__name__)




@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: dict
    text: Optional[str] = None


@dataclass
class StepTimes:
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DecodeSession:
    """One generation: holds the target state, the drafter session and the tokens emitted so far."""

    def __init__(
        self,
        model: StreeLM,
        prompt_ids: Sequence[int],
        drafter_session: Optional[DrafterSession] = None,
        params: SamplingParams = SamplingParams(),
        budget: DraftBudget = DEFAULT_BUDGET,
        max_new_tokens: int = 64,
        stop_token_ids: Sequence[int] = (),
    ):
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if min(prompt) < 0 or max(prompt) >= model.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.params = params
        self.budget = budget
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = set(int(t) for t in stop_token_ids)
        self.drafter = drafter_session
        self.generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        )
        self.output: list[int] = []
        self.done = False
        self.steps = 0
        self.times = StepTimes()
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.fallbacks = 0
        self.accepted_per_step: list[int] = []
        self.state = model.new_state(1, len(prompt) + max_new_tokens + budget.max_nodes + 2)
        self.started = time.perf_counter()
        if len(prompt) > 1:
            model.prefill(torch.tensor([prompt[:-1]], device=model.device), self.state)
            _sync(model.device)
        self.prefill_s = time.perf_counter() - self.started
        self.root = prompt[-1]

    # ----- one step ---------------------------------------------------------------------------
    def _draft(self) -> TokenTree:
        if self.drafter is None:
            return TokenTree.chain([self.root])
        try:
            tree = self.drafter.draft(self.budget)
            why = tree_problem(tree, self.root, self.budget, self.model.vocab_size)
        except Exception as exc:  # a broken drafter costs speed, never output
            why = f"drafter failed: {exc!r}"
        if why is not None:
            self.fallbacks += 1
            if self.fallbacks <= 3 or self.fallbacks % 100 == 0:  # a dead drafter should not flood the log
                log.warning("drafter skipped for this step (%d so far): %s", self.fallbacks, why)
            return TokenTree.chain([self.root])
        return tree

    def _plain_step(self) -> list[int]:
        """No draft: one ``step`` of the model and a sample from the warped logits."""
        t0 = time.perf_counter()
        logits = self.model.step(torch.tensor([self.root], device=self.model.device), self.state)[0]
        probs = warp_logits(logits, self.params).cpu()
        token = int(probs.argmax()) if self.params.greedy else int(torch.multinomial(probs, 1, generator=self.generator))
        _sync(self.model.device)
        self.times.verify_s += time.perf_counter() - t0
        return [token]

    def _tree_verify(self, tree: TokenTree):
        """Tree forward + verification; returns the new tokens and the pending model commit."""
        dev = self.model.device
        t0 = time.perf_counter()
        logits, acts = self.model.tree_forward(TreeBatch.from_trees([tree]), self.state)
        result = verify_tree(tree, logits[0, : tree.num_nodes], self.params, self.generator)
        self.times.verify_s += time.perf_counter() - t0
        path = result.path
        self.num_draft_tokens += tree.num_nodes - 1
        self.num_accepted_draft_tokens += len(path) - 1
        toks = tree.tokens.tolist()

        def commit() -> None:
            t1 = time.perf_counter()
            self.model.commit(self.state, acts, torch.tensor([path], device=dev), torch.tensor([len(path)], device=dev))
            _sync(dev)
            self.times.commit_s += time.perf_counter() - t1

        return [toks[i] for i in path[1:]] + [result.bonus_token], commit

    def _emit(self, new: list[int]) -> list[int]:
        """Append ``new`` to the output up to the token limit or a stop token; sets ``done``."""
        emitted, stopped = take_until_stop(new, self.max_new_tokens - len(self.output), self.stop_token_ids)
        self.output.extend(emitted)
        if stopped or len(self.output) >= self.max_new_tokens:
            self.done = True
        return emitted

    def _commit_drafter(self, new: list[int]) -> None:
        t1 = time.perf_counter()
        try:
            self.drafter.commit(new)
        except Exception as exc:
            log.warning("drafter commit failed (%r); continuing without the drafter", exc)
            self.drafter = DeadSession()
        self.times.draft_s += time.perf_counter() - t1

    def step(self) -> list[int]:
        """Run one draft-verify-commit step; returns the tokens it emitted (empty once done).

        The drafter hears the accepted tokens before the target's commit replay runs, so a
        remote drafter drafts the next tree while the GPU replays.
        """
        if self.done:
            return []
        t0 = time.perf_counter()
        tree = self._draft()
        self.times.draft_s += time.perf_counter() - t0
        if self.drafter is None:
            new, commit = self._plain_step(), None
        else:
            new, commit = self._tree_verify(tree)
        self.steps += 1
        self.accepted_per_step.append(len(new))
        emitted = self._emit(new)
        if self.drafter is not None and not self.done:
            self._commit_drafter(new)
        if commit is not None and not self.done:
            commit()
        self.root = new[-1]
        return emitted

    def finish(self, keep: Optional[int] = None) -> None:
        """End the generation now, keeping the first ``keep`` output tokens (all when None).

        A caller that stops on something the loop cannot see (a stop string) ends it here.
        """
        if keep is not None:
            if not 0 <= keep <= len(self.output):
                raise ValueError(f"finish: keep must be in 0..{len(self.output)}, got {keep}")
            del self.output[keep:]
        self.done = True

    def run(self) -> list[int]:
        while not self.done:
            self.step()
        return self.output

    def close(self) -> None:
        if self.drafter is not None:
            try:
                self.drafter.close()
            except Exception as exc:
                log.warning("drafter close failed: %r", exc)
        self.drafter = None

    @property
    def stats(self) -> dict:
        elapsed = time.perf_counter() - self.started
        n = len(self.output)
        return {
            "steps": self.steps,
            "new_tokens": n,
            "mean_accepted_length": (sum(self.accepted_per_step) / self.steps) if self.steps else 0.0,
            "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
            "decode_tokens_per_s": n / (elapsed - self.prefill_s) if elapsed > self.prefill_s else 0.0,
            "elapsed_s": elapsed,
            "prefill_s": self.prefill_s,
            "draft_s": self.times.draft_s,
            "verify_s": self.times.verify_s,
            "commit_s": self.times.commit_s,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "drafter_fallbacks": self.fallbacks,
        }


def open_drafter(
    drafter: Union[None, str, Drafter],
    prompt_ids: Sequence[int],
    params: SamplingParams,
    draft_model: Optional[StreeLM] = None,
    **options,
) -> Optional[DrafterSession]:
    """A drafter session from a name, a ``Drafter`` object, or None/'none' for plain decoding."""
    built = _build_drafter(drafter, draft_model, options)
    return None if built is None else built.open(list(prompt_ids), params)


def generate(
    model: StreeLM,
    prompt_ids,
    drafter: Union[None, str, Drafter] = None,
    draft_model: Optional[StreeLM] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    budget: Optional[DraftBudget] = None,
    stop_token_ids: Sequence[int] = (),
    tokenizer=None,
    cuda_graphs: Optional[bool] = None,
    max_batch: int = 64,
    admit_hold_steps: Optional[int] = None,
    **drafter_options,
):
    """Generate up to ``max_new_tokens`` after each prompt; speculation never changes the output's distribution.

    ``prompt_ids``: one prompt (a list of ids or a 1-D tensor) or a list of prompts, which returns a
    list of results. All prompts run together in one batched ``Engine`` (up to ``max_batch`` at a
    time). Draft-model trees (chain, static, beam; ``tree="auto"`` lets the engine pick per step by
    goodput) are drafted on the device inside the step; other drafters hand in trees per step. On
    CUDA each step replays one CUDA graph unless ``cuda_graphs=False``. With more prompts than slots, free
    slots may wait up to ``admit_hold_steps`` steps (default ``engine.ADMIT_HOLD_STEPS``; 0: never) for running
    sequences about to finish, so that queued prompts share one prefill.
    """
    prompts, single = _as_prompts(prompt_ids)
    hold = ADMIT_HOLD_STEPS if admit_hold_steps is None else check_hold_steps(admit_hold_steps)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if draft_model is not None and draft_model.vocab_size != model.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_model.vocab_size}) differs from the target's ({model.vocab_size})"
        )
    budget = budget or DEFAULT_BUDGET
    built = _build_drafter(drafter, draft_model, drafter_options, cache_on=model)
    device = _device_path(built, budget)
    if built is None:
        engine_drafter, shapes = None, ["none"]
    elif device is not None:
        engine_drafter, shapes = device
    else:
        engine_drafter, shapes = "host", ()
    longest = max(len(p) for p in prompts)
    engine = engine_for(model, engine_drafter, shapes, min(max_batch, len(prompts)), longest + max_new_tokens,
                        cuda_graphs, budget)
    engine.reseed(seed)
    engine.admit_hold_steps = hold
    stops = frozenset(int(t) for t in stop_token_ids)
    requests = []
    try:
        for p in prompts:
            session = built.open(list(p), params) if engine_drafter == "host" else None
            requests.append(Request(p, max_new_tokens, params, stops, drafter_session=session))
        engine.run(requests)
    finally:
        for r in requests:
            if r.drafter_session is not None and not r.done:
                r.drafter_session.close()
    host = engine.host_step_stats
    # the engine's numbers, made once per call and shared by every result (made per result, a batch-64 call built
    # 64 goodput tables, ~1.5 ms on the dev machine's CPU): cumulative over the engine's life, as it is reused
    shared = {"engine_metrics": dict(engine.metrics)}
    if engine.goodput is not None:
        shared["goodput"] = engine.goodput.table()
    results = []
    for r in requests:
        stats = {**r.stats, **host, "decode_tokens_per_s": r.stats["tokens_per_s"], **shared}
        text = tokenizer.decode(r.output) if tokenizer is not None else None
        results.append(GenerationResult(token_ids=r.output, stats=stats, text=text))
    return results[0] if single else results


def engine_room(tokens: int) -> int:
    """The room per sequence an engine gets for ``tokens``: rounded up to a multiple of 1024 (see ``engine_for``)."""
    return -(-tokens // 1024) * 1024


def engine_for(model, drafter, shapes, max_batch: int, max_seqlen: int, cuda_graphs, budget) -> Engine:
    """The model's cached engine for this drafter and these shapes (its CUDA graphs are reused across calls).

    Room per sequence is rounded up to a multiple of 1024 tokens, and an engine with more room than a
    call needs serves it: prompts of mixed lengths must not rebuild the engine (and recapture every
    graph) each time they cross a multiple of 1024. A longer call replaces it with a larger one.
    """
    room = engine_room(max_seqlen)
    owner = id(drafter) if drafter not in (None, "host") else drafter  # one engine per device drafter: it owns its state
    config = (tuple(str(s) for s in shapes), max_batch, cuda_graphs, budget)
    cache = model.__dict__.setdefault("_stree_engines", {})
    cached = cache.get(owner)
    if cached is not None and not cached[1].owns_drafter:  # another engine took its drafter over since
        cached = None
    if cached is not None and cached[0] == config:
        if cached[2] >= room and not cached[1].has_work:
            return cached[1]
        room = max(room, cached[2])
    if cached is None and len(cache) >= 8:  # bounded: each engine holds state for max_batch sequences
        cache.pop(next(iter(cache)))
    engine = Engine(model, drafter, shapes, max_batch=max_batch, max_seqlen=room, cuda_graphs=cuda_graphs,
                    goodput=len(shapes) > 1, budget=budget)
    if cached is not None:  # same drafter: its measured acceptance carries over (Engine.inherit_acceptance)
        engine.inherit_acceptance(cached[1])
    if engine.cuda:  # compile the prefill kernels and capture every prefill bucket now, not during some request
        engine.warm_up_prefill()
    cache[owner] = (config, engine, room)
    return engine


def warm_up_engines(model: StreeLM) -> int:
    """Capture every step graph of every idle goodput-controlled engine ``generate`` has cached on ``model``
    and not warmed yet (``Engine.warm_up``: each shape greedy and sampled, plain steps with and without a
    drafter to feed, the drafter's catch-up). A first ``generate`` call only captures the paths its own
    steps took, so a later call could still stall on a capture or a kernel compile; benchmarks call this
    before timing, as the server does at start. Their goodput statistics start afresh. Returns the number
    of engines warmed."""
    engines = [e for _, e, _ in model.__dict__.get("_stree_engines", {}).values()
               if e.goodput is not None and not e.has_work and not e.warmed_up]
    for engine in engines:
        engine.warm_up()
    return len(engines)


def release_engines(model: StreeLM, drafter=None) -> int:
    """Forget the engines ``generate`` cached on ``model`` for ``drafter`` (every engine with ``drafter=None``),
    so that their state, buffers and graphs can be freed: at the 2.7B shape and batch 64 one engine's SSM state
    alone is 10 GiB, and a benchmark that tries several drafters ran out of memory with all of them cached.
    Returns the number of engines released."""
    cache = model.__dict__.get("_stree_engines", {})
    keys = [k for k in cache if drafter is None or k == id(drafter)]
    for k in keys:
        del cache[k]
    if keys and model.device.type == "cuda":
        import gc

        gc.collect()  # engines hold reference cycles (graphs, closures): free them before the allocator's cache
        torch.cuda.empty_cache()
    return len(keys)


def _as_prompts(prompt_ids) -> tuple[list[list[int]], bool]:
    """``(prompts, single)``: one prompt (ids or a 1-D tensor) or a list of prompts, as lists of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() <= 1:
            return [prompt_ids.reshape(-1).tolist()], True
        return [row.tolist() for row in prompt_ids], False
    items = list(prompt_ids)
    if items and all(isinstance(x, (list, tuple, torch.Tensor)) for x in items):  # no tensor round trip for lists
        return [x.reshape(-1).tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x] for x in items], False
    return [[int(x) for x in items]], True


def _build_drafter(drafter, draft_model, options, cache_on=None) -> Optional[Drafter]:
    """The drafter ``drafter`` names, or ``drafter`` itself when it is one. With ``cache_on`` (the target model)
    a named drafter is built once per set of options and reused: the engine, with its CUDA graphs, is
    cached per device drafter, so a fresh drafter per call would rebuild and recapture it every call."""
    if drafter is None or drafter == "none":
        return None
    if isinstance(drafter, str):
        opts = {k: v for k, v in options.items() if v is not None}
        if draft_model is not None:
            opts["draft_model"] = draft_model
        if cache_on is None:
            return create_drafter(drafter, **opts)
        key = (drafter, tuple(sorted((k, _option_key(v)) for k, v in opts.items())))
        cache = cache_on.__dict__.setdefault("_stree_drafters", {})
        hit = cache.get(key)
        if hit is not None:
            return hit[0]
        built = create_drafter(drafter, **opts)
        if len(cache) >= 8:  # bounded like the engine cache
            cache.pop(next(iter(cache)))
        cache[key] = (built, opts)  # the options are kept alive, so the ids in the key stay theirs
        drafter = built
    if not hasattr(drafter, "open"):
        raise ValueError(f"drafter must be a name or a Drafter, got {type(drafter).__name__}")
    return drafter


def _option_key(value):
    """A drafter option as part of a cache key: plain values by value, objects (models, tensors) by identity."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return tuple(value)
    return ("id", id(value))


def _device_path(drafter, budget: DraftBudget):
    """``(DeviceDrafter, shapes)`` when the drafter drafts on the device within ``budget``, else None."""
    make = getattr(drafter, "device_drafter", None)
    if make is None:
        return None
    made = make()
    if made is None:
        return None
    device_drafter, shapes = made
    fits = [s for s in shapes if s.kind == "none" or (s.num_nodes <= budget.max_nodes
            and s.max_depth <= budget.max_depth and s.max_width <= budget.max_width)]
    if not any(s.kind != "none" for s in fits):
        return None
    return device_drafter, fits


__all__ = ["DecodeSession", "GenerationResult", "generate", "open_drafter", "tree_problem", "warm_up_engines",
           "DraftMode"]
