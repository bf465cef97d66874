"""Drafter registry: built-in drafters by name, third-party ones through the ``stree.drafters`` entry points.

A third-party package adds a drafter by declaring, in its own pyproject.toml,
``[project.entry-points."stree.drafters"] mydrafter = "mypkg:make_drafter"`` where
``make_drafter(**options)`` returns a ``Drafter``. ``create_drafter("mydrafter", ...)`` then finds it.
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from typing import Callable

from .drafter import Drafter

ENTRY_POINT_GROUP = "stree.drafters"

DrafterFactory = Callable[..., Drafter]
_FACTORIES: dict[str, DrafterFactory] = {}


def register_drafter(name: str, factory: DrafterFactory, *, replace: bool = False) -> None:
    """Make ``factory`` available as drafter ``name``."""
    if not name or any(c in name for c in "+:/ "):
        raise ValueError(f"invalid drafter name {name!r}: no '+', ':', '/' or spaces")
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise ValueError(f"a drafter named {name!r} is already registered")
    _FACTORIES[name] = factory


def _entry_point_factories() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_drafters() -> list[str]:
    """Names of every drafter that ``create_drafter`` can build."""
    _load_builtins()
    return sorted(set(_FACTORIES) | set(_entry_point_factories()))


def get_drafter_factory(name: str) -> DrafterFactory:
    _load_builtins()
    if name in _FACTORIES:
        return _FACTORIES[name]
    eps = _entry_point_factories()
    if name in eps:
        try:
            factory = eps[name].load()
        except Exception as exc:  # a broken plugin must say which one
            raise ValueError(f"drafter plugin {name!r} failed to load: {exc}") from exc
        _FACTORIES[name] = factory
        return factory
    raise ValueError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")


def create_drafter(name: str, **options) -> Drafter:
    """Build the drafter registered as ``name`` with its options (e.g. ``draft_model=``).

    ``fusion:A+B`` builds drafters A and B with the same options and merges their trees each step.

    Options the factory does not take are dropped, so callers can offer the same set to any
    drafter (a draft model to n-gram, say); a factory with ``**kwargs`` gets them all.
    """
    if name.startswith("fusion:"):
        parts = [p for p in name[len("fusion:"):].split("+") if p]
        if len(parts) < 2:
            raise ValueError(f"fusion wants two or more drafters, as in 'fusion:mamba+ngram'; got {name!r}")
        subs = [create_drafter(part, **options) for part in parts]
        scorer = None
        if options.get("draft_model") is not None:  # RASD: rank merged branches by the draft model
            from stree.drafter_service.draft_model_scorer import DraftModelScorer

            scorer = DraftModelScorer(options["draft_model"])
        return get_drafter_factory("fusion")(drafters=subs, scorer=scorer)
    factory = get_drafter_factory(name)
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return factory(**options)
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = {p.name for p in params}
        options = {k: v for k, v in options.items() if k in accepted}
    return factory(**options)


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from stree.drafter_service import builtin  # noqa: F401  (registers on import)
