"""House rules the code keeps, checked on its text: small classes in the engine, contracts declared rather than
probed, no caches hidden on other objects, no history in code, settings read through the registry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("protocols", "kernels", "proto", "verifier", "drafter_service", "training", "stree")
MAX_CLASS_LINES, MAX_CLASS_METHODS = 300, 20


def _sources(*dirs):
    for folder in dirs:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_engine_classes_stay_small():
    big = []
    for path in _sources("verifier/decode"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if lines > MAX_CLASS_LINES or methods > MAX_CLASS_METHODS:
                    big.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines, {methods} methods)")
    assert not big, big


def test_the_engine_never_probes_a_drafter():
    """What a drafter offers is declared in protocols/ (flags and methods), never discovered with hasattr."""
    probes = []
    for path in _sources("verifier/decode"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(hasattr|getattr)\(\s*[\w.]*drafter", line):
                probes.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not probes, probes


def test_no_cache_hides_on_another_object():
    hidden = []
    for path in _sources(*PACKAGE_DIRS):
        text = path.read_text()
        for pattern in (r"__dict__\[\"_stree", r"__dict__\.setdefault\(\"_stree", r"\._stree_\w+\s*="):
            hidden += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert not hidden, hidden


def test_code_holds_no_benchmark_history():
    pointers = []
    for path in _sources(*PACKAGE_DIRS, "tests", "bench"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"BENCHMARKS(\.md)? §|§0", line) and path.name != "test_house.py":
                pointers.append(f"{path.relative_to(ROOT)}:{i}")
    assert not pointers, pointers


def test_settings_are_read_through_the_registry():
    """``os.environ`` reads of ``STREE_*`` variables happen only in protocols/settings.py."""
    reads = []
    for path in _sources(*PACKAGE_DIRS):
        if path.name == "settings.py" and path.parent.name == "protocols":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"environ(\.get)?[\[(]\s*[\"']STREE_|getenv\(\s*[\"']STREE_", line):
                reads.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not reads, reads
