"""The settings registry: every ``STREE_*`` name the package mentions is declared once, values are checked, and
forcing from Python overrides the environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stree.protocols import settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("protocols", "kernels", "proto", "verifier", "drafter_service", "training", "stree")


def test_every_stree_variable_in_the_package_is_declared():
    named = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r"\bSTREE_[A-Z0-9_]+\b", path.read_text()))
    undeclared = sorted(n for n in named if n not in settings.REGISTRY)
    assert not undeclared, f"declare these in protocols/settings.py: {undeclared}"


def test_values_default_checked_and_forced(monkeypatch):
    monkeypatch.delenv(settings.KERNELS, raising=False)
    assert settings.value(settings.KERNELS) == "auto"
    monkeypatch.setenv(settings.KERNELS, "torch")
    assert settings.value(settings.KERNELS) == "torch"
    monkeypatch.setenv(settings.KERNELS, "")  # empty counts as unset
    assert settings.value(settings.KERNELS) == "auto"
    monkeypatch.setenv(settings.KERNELS, "gpu")
    with pytest.raises(ValueError, match="STREE_KERNELS='gpu'"):
        settings.value(settings.KERNELS)
    settings.force(settings.KERNELS, "triton")
    try:
        assert settings.value(settings.KERNELS) == "triton"
    finally:
        settings.force(settings.KERNELS, None)
    with pytest.raises(ValueError, match="STREE_KERNELS"):
        settings.force(settings.KERNELS, "gpu")
    with pytest.raises(KeyError, match="STREE_NOPE"):
        settings.value("STREE_NOPE")


def test_snapshot_leaves_secrets_out(monkeypatch):
    monkeypatch.setenv(settings.API_KEY, "hunter2")
    snap = settings.snapshot()
    assert settings.API_KEY not in snap and "hunter2" not in str(snap)
    assert snap[settings.PDL] in ("on", "off")


def test_readme_lists_every_setting():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in settings.REGISTRY if name not in readme]
    assert not missing, f"README's settings section misses {missing}"
