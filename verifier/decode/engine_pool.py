"""Engines (and the named drafters they run) kept across ``generate`` calls, so their CUDA graphs are reused.

An ``EnginePool`` is owned by its caller: ``stree.generate`` uses ``DEFAULT_POOL`` unless it is given one (a
benchmark or a server keeps its own). Per target model (held weakly: a pool never keeps a model alive) it keeps one
engine per device drafter (an engine owns its drafter's slot state) and per host/plain path, and one drafter per
name and set of options.

Room per sequence is rounded up to a multiple of 1024 tokens, and an engine with more room than a call needs serves
it: prompts of mixed lengths must not rebuild the engine (and recapture every graph) each time they cross a multiple
of 1024. A longer call replaces it with a larger one, which inherits what goodput control learned.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from stree.protocols.drafter import DraftBudget, Drafter
from stree.protocols.registry import create_drafter
from stree.verifier.decode.engine import Engine

MAX_PER_MODEL = 8
"""Engines (and named drafters) kept per model: each engine holds state for its whole batch."""


def engine_room(tokens: int) -> int:
    """The room per sequence an engine gets for ``tokens``: rounded up to a multiple of 1024."""
    return -(-tokens // 1024) * 1024


@dataclass
class _Entry:
    config: tuple
    engine: Engine
    room: int


class EnginePool:
    """Engines and named drafters per target model (see the module docstring)."""

    def __init__(self, max_per_model: int = MAX_PER_MODEL):
        self.max_per_model = int(max_per_model)
        self._engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {owner: _Entry}
        self._drafters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {key: (drafter, opts)}

    def engines(self, model) -> list[Engine]:
        """The engines kept for ``model``."""
        return [e.engine for e in self._engines.get(model, {}).values()]

    def engine_for(self, model, drafter, shapes, max_batch: int, max_seqlen: int, cuda_graphs,
                   budget: DraftBudget) -> Engine:
        """The kept engine for ``model`` and this drafter (None, "host" or a ``DeviceDrafter``) and shapes, or a new
        one (which replaces the kept one; it starts from the acceptance that one measured)."""
        room = engine_room(max_seqlen)
        owner = id(drafter) if drafter not in (None, "host") else drafter
        config = (tuple(str(s) for s in shapes), max_batch, cuda_graphs, budget)
        cache = self._engines.setdefault(model, {})
        kept = cache.get(owner)
        if kept is not None and not (kept.engine.drafter is None or kept.engine.drafter.owned):
            kept = None  # another engine took its drafter over since
        if kept is not None and kept.config == config:
            if kept.room >= room and not kept.engine.has_work:
                return kept.engine
            room = max(room, kept.room)
        if kept is None and len(cache) >= self.max_per_model:
            cache.pop(next(iter(cache)))
        engine = Engine(model, drafter, shapes, max_batch=max_batch, max_seqlen=room, cuda_graphs=cuda_graphs,
                        goodput=len(shapes) > 1, budget=budget)
        if kept is not None:
            engine.inherit_acceptance(kept.engine)
        if engine.cuda:  # compile the prefill kernels and capture every prefill bucket now, not during a request
            engine.warm_up_prefill()
        cache[owner] = _Entry(config, engine, room)
        return engine

    def drafter_for(self, model, name: str, options: dict) -> Drafter:
        """The drafter ``name`` built with ``options`` for ``model``, built once and kept: the engine, with its CUDA
        graphs, is kept per device drafter, so a fresh drafter per call would rebuild and recapture it every call."""
        key = (name, tuple(sorted((k, _option_key(v)) for k, v in options.items())))
        cache = self._drafters.setdefault(model, {})
        if key not in cache:
            if len(cache) >= self.max_per_model:
                cache.pop(next(iter(cache)))
            cache[key] = (create_drafter(name, **options), options)  # the options stay alive: their ids stay theirs
        return cache[key][0]

    def warm_up(self, model) -> int:
        """Capture every step graph of each idle goodput-controlled engine kept for ``model`` and not warmed yet
        (``Engine.warm_up``); returns how many were warmed. Benchmarks call it before timing."""
        engines = [e for e in self.engines(model) if e.goodput is not None and not e.has_work and not e.warmed_up]
        for engine in engines:
            engine.warm_up()
        return len(engines)

    def release(self, model, drafter: Optional[object] = None) -> int:
        """Forget the engines kept for ``model`` and ``drafter`` (every one with None), so that their state and graphs
        can be freed; returns how many."""
        cache = self._engines.get(model, {})
        keys = [k for k in cache if drafter is None or k == id(drafter)]
        for k in keys:
            del cache[k]
        if keys and model.device.type == "cuda":
            gc.collect()  # engines hold reference cycles (graphs, closures): free them before the allocator's cache
            torch.cuda.empty_cache()
        return len(keys)


def _option_key(value):
    """A drafter option as part of a cache key: plain values by value, objects (models, tensors) by identity."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return tuple(value)
    return ("id", id(value))


DEFAULT_POOL = EnginePool()
"""The pool ``stree.generate`` keeps its engines in unless it is given another."""
