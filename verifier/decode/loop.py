"""``generate``: the one-call Python API. Every call runs on the batched ``Engine``; engines are kept in an
``EnginePool`` (``DEFAULT_POOL`` unless the caller passes its own) so their CUDA graphs serve later calls.

A drafter is a name (built once per target and options), a ``Drafter`` object, or None for plain decoding. One
that offers a device drafter (``Drafter.device_drafter``) drafts inside the engine's step graph; any other drafts on
the host through a session per prompt, and the engine pads its trees into its step.
"""

from __future__ import annotations

import numbers

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch

from stree.protocols.device_drafter import DeviceOffer
from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget, Drafter, drafter_problem, session_params, session_seeds
from stree.protocols.sampling import SamplingParams
from stree.verifier.decode.admission import check_hold_steps
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS, Request
from stree.verifier.decode.engine_pool import DEFAULT_POOL, EnginePool, engine_room
from stree.verifier.decode.host_trees import close_quietly
from stree.verifier.model.lm import StreeLM


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: dict
    text: Optional[str] = None


def generate(
    model: StreeLM,
    prompt_ids,
    drafter: Union[None, str, Drafter] = None,
    draft_model: Optional[StreeLM] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Union[None, int, Sequence[int]] = None,
    budget: Optional[DraftBudget] = None,
    stop_token_ids: Sequence[int] = (),
    tokenizer=None,
    cuda_graphs: Optional[bool] = None,
    max_batch: int = 64,
    admit_hold_steps: Optional[int] = None,
    pool: Optional[EnginePool] = None,
    **drafter_options,
):
    """Generate up to ``max_new_tokens`` after each prompt; speculation never changes the output's distribution.

    ``prompt_ids``: one prompt (a list of ids or a 1-D tensor) or a list of prompts, which returns a list of
    results. All prompts run together in one batched ``Engine`` (up to ``max_batch`` at a time). Draft-model trees
    (chain, static, beam; ``tree="auto"`` lets the engine pick per step by goodput) are drafted on the device inside
    the step; other drafters hand in trees per step. On CUDA each step replays one CUDA graph unless
    ``cuda_graphs=False``. With more prompts than slots, free slots may wait up to ``admit_hold_steps`` steps
    (default ``ADMIT_HOLD_STEPS``; 0: never) for running sequences about to finish, so that queued prompts share one
    prefill. ``pool``: where the engine is kept (default ``DEFAULT_POOL``).

    ``seed`` keys every random draw of a request: one integer (each prompt draws its own seed from it, so a call is
    reproducible), one integer per prompt (a request's tokens then depend only on its prompt and its seed: the same
    alone or in any batch, for a fixed tree), or None (fresh seeds).
    """
    prompts, single = _as_prompts(prompt_ids)
    pool = pool or DEFAULT_POOL
    hold = ADMIT_HOLD_STEPS if admit_hold_steps is None else check_hold_steps(admit_hold_steps)
    seeds = request_seeds(seed, len(prompts))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    if draft_model is not None and draft_model.vocab_size != model.vocab_size:
        raise ValueError(
            f"draft model vocabulary ({draft_model.vocab_size}) differs from the target's ({model.vocab_size})"
        )
    budget = budget or DEFAULT_BUDGET
    built = _build_drafter(drafter, draft_model, drafter_options, model, pool)
    offer = device_offer(built, budget)
    if built is None:
        engine_drafter, shapes = None, ["none"]
    elif offer is not None:
        engine_drafter, shapes = offer.drafter, offer.shapes
    else:
        engine_drafter, shapes = "host", ()
    longest = max(len(p) for p in prompts)
    engine = pool.engine_for(model, engine_drafter, shapes, min(max_batch, len(prompts)), longest + max_new_tokens,
                             cuda_graphs, budget)
    engine.admission.hold_steps = hold
    stops = frozenset(int(t) for t in stop_token_ids)
    requests = []
    try:
        for p, own in zip(prompts, seeds):  # each request, and its drafter session, draws on its own seed
            mine = replace(params, seed=own)
            session = built.open(list(p), session_params(mine)) if engine_drafter == "host" else None
            requests.append(Request(p, max_new_tokens, mine, stops, drafter_session=session))
        engine.run(requests)
    finally:
        for r in requests:
            if r.drafter_session is not None and not r.done:
                close_quietly(r)
    if single and requests[0].finish_reason == "error":
        raise RuntimeError(f"generation failed: {requests[0].error_message}")
    # the engine's numbers, made once per call and shared by every result: cumulative over the engine's life
    shared = {"engine_metrics": dict(engine.metrics), **engine.host_step_stats}
    if engine.goodput is not None:
        shared["goodput"] = engine.goodput.table()
    results = []
    for r in requests:
        stats = {**r.stats, "decode_tokens_per_s": r.stats["tokens_per_s"], **shared}
        text = tokenizer.decode(r.output) if tokenizer is not None else None
        results.append(GenerationResult(token_ids=r.output, stats=stats, text=text))
    return results[0] if single else results


def request_seeds(seed: Union[None, int, Sequence[int]], count: int) -> list[int]:
    """One seed per request: ``seed`` itself when it is a sequence (one per prompt), else ``count`` seeds drawn from
    it (``session_seeds``: reproducible for an integer; for None, from torch's global generator, so a test seeded
    there replays)."""
    if seed is None:
        return [int(s) for s in torch.randint(0, 2**62, (count,))]
    if isinstance(seed, numbers.Integral):
        return session_seeds(int(seed), count)
    seeds = list(seed)
    if not all(isinstance(s, numbers.Integral) for s in seeds):
        raise ValueError(f"seed must be an integer or one integer per prompt, got {seed!r}")
    seeds = [int(s) for s in seeds]
    if len(seeds) != count:
        raise ValueError(f"seed: {len(seeds)} seeds given for {count} prompts (give one integer, or one per prompt)")
    return seeds


def device_offer(drafter: Optional[Drafter], budget: DraftBudget) -> Optional[DeviceOffer]:
    """``drafter``'s device drafter with the shapes that fit ``budget``, or None when it drafts on the host only
    (or no drafted shape fits)."""
    offer = drafter.device_drafter() if drafter is not None else None
    if offer is None:
        return None
    fits = [s for s in offer.shapes if s.kind == "none" or (s.num_nodes <= budget.max_nodes
            and s.max_depth <= budget.max_depth and s.max_width <= budget.max_width)]
    if not any(s.kind != "none" for s in fits):
        return None
    return DeviceOffer(offer.drafter, fits)


def engine_for(model, drafter, shapes, max_batch: int, max_seqlen: int, cuda_graphs, budget):
    """``DEFAULT_POOL.engine_for``: the kept engine for this model, drafter and shapes, or a new one."""
    return DEFAULT_POOL.engine_for(model, drafter, shapes, max_batch, max_seqlen, cuda_graphs, budget)


def warm_up_engines(model: StreeLM, pool: Optional[EnginePool] = None) -> int:
    """Capture every step graph of the goodput-controlled engines ``generate`` keeps for ``model`` and has not warmed
    yet (``EnginePool.warm_up``); returns how many were warmed. Benchmarks call it before timing."""
    return (pool or DEFAULT_POOL).warm_up(model)


def release_engines(model: StreeLM, drafter=None, pool: Optional[EnginePool] = None) -> int:
    """Forget the engines ``generate`` keeps for ``model`` and ``drafter`` (all of them with None), so their state and
    graphs can be freed; returns how many (``EnginePool.release``)."""
    return (pool or DEFAULT_POOL).release(model, drafter)


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


def _build_drafter(drafter, draft_model, options, model, pool: EnginePool) -> Optional[Drafter]:
    """The drafter ``drafter`` names (kept in ``pool`` per target and options), or ``drafter`` itself."""
    if drafter is None or drafter == "none":
        return None
    if isinstance(drafter, str):
        opts = {k: v for k, v in options.items() if v is not None}
        if draft_model is not None:
            opts["draft_model"] = draft_model
        return pool.drafter_for(model, drafter, opts)
    why = drafter_problem(drafter)
    if why is not None:
        raise ValueError(f"drafter must be a name or a Drafter: {why}")
    return drafter


__all__ = ["GenerationResult", "device_offer", "engine_room", "generate", "release_engines", "warm_up_engines"]
