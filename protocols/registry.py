"""Drafter registry: drafters by name, from ``register_drafter`` or the ``stree.drafters`` entry points.

The built-in drafters are entry points of this package too (see pyproject.toml), so this, the
lowest layer, never imports a drafter.

A third-party package adds a drafter by declaring, in its own pyproject.toml,
``[project.entry-points."stree.drafters"] mydrafter = "mypkg:make_drafter"`` where
``make_drafter(**options)`` returns a ``Drafter``. ``create_drafter("mydrafter", ...)`` then finds it.
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from typing import Callable

from stree.protocols.drafter import Drafter, drafter_problem

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
    return sorted(set(_FACTORIES) | set(_entry_point_factories()))


def get_drafter_factory(name: str) -> DrafterFactory:
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
        # with a draft model the fusion factory ranks merged branches by it (RASD)
        return get_drafter_factory("fusion")(drafters=subs, draft_model=options.get("draft_model"))
    factory = get_drafter_factory(name)
    missing = missing_options(factory, options)
    if missing:  # e.g. retrieval without a datastore, or "fusion" without its parts
        raise ValueError(f"drafter {name!r} needs {', '.join(missing)}, which this caller did not provide")
    built = factory(**filter_options(factory, options))
    why = drafter_problem(built)
    if why is not None:
        raise TypeError(f"drafter {name!r} does not follow the Drafter protocol: {why}")
    return built


def filter_options(factory: Callable, options: dict) -> dict:
    """The options ``factory`` accepts (all of them when it takes ``**kwargs`` or hides its signature)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return dict(options)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(options)
    accepted = {p.name for p in params}
    return {k: v for k, v in options.items() if k in accepted}


def missing_options(factory: Callable, options: dict) -> list[str]:
    """Required keyword parameters of ``factory`` that ``options`` lacks (none when its signature is hidden)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in options]
