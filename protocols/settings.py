"""Every ``STREE_*`` environment setting, declared once: its name, default, allowed values and meaning.

Code reads a setting through ``value(NAME)`` and never through ``os.environ`` directly, so this table is the
whole list of switches a process can be run with (README prints it; benchmark records store ``snapshot()``).
A value outside a setting's ``choices`` is refused with the setting's name. ``force`` overrides the
environment from Python for this process (``stree.kernels.backend.use`` and ``stree.kernels.pdl.use`` call it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Setting:
    """One environment switch. ``choices`` empty: any string (a path, a key)."""

    name: str
    default: Optional[str]
    meaning: str
    choices: tuple = ()
    secret: bool = False  # never printed or recorded (an API key)


REGISTRY: dict[str, Setting] = {}


def _declare(name: str, default: Optional[str], meaning: str, choices: tuple = (), secret: bool = False) -> str:
    REGISTRY[name] = Setting(name, default, meaning, tuple(choices), secret)
    return name


KERNELS = _declare(
    "STREE_KERNELS", "auto",
    "Which implementation of each op runs: `triton` kernels, the plain-PyTorch `torch` references, or `auto` "
    "(Triton on CUDA tensors, PyTorch on the CPU).",
    ("auto", "triton", "torch"))
PDL = _declare(
    "STREE_PDL", "on",
    "Programmatic dependent launch for the Triton kernels on Hopper GPUs (`off` for debugging or profiling one "
    "kernel at a time; outputs are the same bits either way).",
    ("on", "off"))
NUMERICS = _declare(
    "STREE_NUMERICS", "exact",
    "How the model's ops round: `exact` (the default, every dtype) computes every row the same way whatever the row "
    "count, batch, tree shape or step, so speculative greedy output is bit-identical to plain greedy in bf16/fp16 too "
    "(one fixed-tile GEMM for every projection and the LM head, a fixed key split in attention, the decode step's "
    "recurrence walked along every tree path and replayed at commit); `fast` keeps the per-shape fastest kernels "
    "(cuBLAS or few-row GEMMs chosen by timing, fused norm prologues, the chunked tree scan), whose rounding depends "
    "on the row count and tree shape.",
    ("exact", "fast"))
API_KEY = _declare(
    "STREE_API_KEY", None,
    "The API key servers require (`Authorization: Bearer KEY`) when `--api-key` is not given; empty or unset: none.",
    secret=True)
TLS_CA = _declare(
    "STREE_TLS_CA", None,
    "A CA certificate file the verifier trusts for `grpcs://` drafter services when none is passed.")
SUPERVISED = _declare(
    "STREE_SUPERVISED", None,
    "Set by `stree serve` / `stree drafter-service` on the child process they supervise (internal).",
    ("1",))
TEST_SEED = _declare(
    "STREE_TEST_SEED", None,
    "The test suite's base seed (random and printed when unset); set it to replay a failing test.")

_FORCED: dict[str, Optional[str]] = {}


def setting(name: str) -> Setting:
    """The declaration of ``name`` (a KeyError names an undeclared setting)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared stree setting (protocols/settings.py)") from None


def value(name: str) -> Optional[str]:
    """``name``'s value: forced from Python, else the environment (empty counts as unset), else its default."""
    decl = setting(name)
    forced = _FORCED.get(name)
    raw = forced if forced is not None else (os.environ.get(name) or None)
    if raw is None:
        return decl.default
    if decl.choices and raw not in decl.choices:
        raise ValueError(f"{name}={raw!r} is not one of {', '.join(decl.choices)}")
    return raw


def force(name: str, raw: Optional[str]) -> None:
    """Override ``name`` for this process (``None`` goes back to the environment); a bad value is refused."""
    decl = setting(name)
    if raw is not None and decl.choices and raw not in decl.choices:
        raise ValueError(f"unknown {name} value {raw!r}; choose from {', '.join(decl.choices)}")
    _FORCED[name] = raw


def forced(name: str) -> Optional[str]:
    """What ``force`` set for ``name`` (None: nothing, the environment decides)."""
    setting(name)
    return _FORCED.get(name)


def snapshot() -> dict:
    """Every non-secret setting's current value: what a benchmark record stores beside its command."""
    return {name: value(name) for name, decl in REGISTRY.items() if not decl.secret and name != TEST_SEED}


def markdown_table() -> str:
    """The registry as a Markdown table (README's settings section is checked against it)."""
    rows = ["| variable | default | values | meaning |", "| --- | --- | --- | --- |"]
    for decl in REGISTRY.values():
        default = f"`{decl.default}`" if decl.default is not None else "unset"
        choices = ", ".join(f"`{c}`" for c in decl.choices) if decl.choices else "any"
        rows.append(f"| `{decl.name}` | {default} | {choices} | {decl.meaning} |")
    return "\n".join(rows)
