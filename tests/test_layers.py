"""The import-direction contract (pyproject's [tool.importlinter]) holds, and it would catch a violation.

import-linter reads an installed tree, so the package is installed into a temporary folder first
(the source checkout maps stree.<folder> onto top-level folders, which it cannot walk).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([str(LINT), "--config", str(REPO / "pyproject.toml")], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    if not LINT.exists():
        pytest.fail("lint-imports is missing: it comes with the test extras (import-linter)")
    site = tmp_path_factory.mktemp("layers") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(REPO)], check=True, capture_output=True, timeout=600)
    return site


def test_imports_point_down_only(installed):
    result = _lint(installed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_a_planted_upward_import_breaks_the_contract(installed):
    # protocols is the lowest layer: make it import the verifier's server and the contract must fail
    victim = installed / "stree" / "protocols" / "sampling.py"
    original = victim.read_text()
    victim.write_text(original + "\nimport stree.verifier.service.server  # planted violation\n")
    try:
        result = _lint(installed)
    finally:
        victim.write_text(original)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert "stree.protocols.sampling -> stree.verifier.service.server" in result.stdout


def test_every_source_package_is_installed(installed):
    """A folder with an __init__.py that pyproject's package list forgets would be missing when installed."""
    mapping = {"stree": "stree", "protocols": "protocols", "kernels": "kernels", "proto": "proto",
               "verifier": "verifier", "drafter_service": "drafter_service", "training": "training"}
    missing = []
    for top, src in mapping.items():
        for init in (REPO / src).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / src)
            dest = installed / "stree" / ("" if top == "stree" else top) / rel / "__init__.py"
            if not dest.exists():
                missing.append(str(init.parent.relative_to(REPO)))
    assert not missing, f"packages missing from pyproject's [tool.setuptools] packages: {missing}"
