"""The ``STREE_PDL`` switch: on by default, forced from Python, a bad value refused, never on for the CPU
interpreter; and every stree Triton kernel takes part, so one kernel launched
without its wait cannot slip in. (Bit-for-bit equality with PDL on and off is checked on the GPU:
``tests/gpu/test_pdl_gpu.py``.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from stree.kernels import pdl

KERNEL_DIR = Path(pdl.__file__).parent
WITHOUT_PDL: set = set()  # kernels that may not take PDL (none today)
# kernels whose body hands PDL to a tile function that loads only weights before its wait
WAITS_IN_TILE = {"_linear_rows_kernel": "linear_rows_tile"}
OUTPUT_OF_EARLIER_KERNELS = ("x_ptr", "r_ptr", "z_ptr", "nw_ptr", "b_ptr", "y_ptr", "rout_ptr", "tl.store")


@pytest.fixture(autouse=True)
def _reset():
    yield
    pdl.use(None)


def test_setting_defaults_on_and_is_forced_or_refused(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.setting() == "on"
    monkeypatch.setenv(pdl.ENV, "off")
    assert pdl.setting() == "off"
    pdl.use("on")
    assert pdl.setting() == "on"
    with pytest.raises(ValueError, match="STREE_PDL value"):
        pdl.use("maybe")
    pdl.use(None)
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="STREE_PDL='yes'"):
        pdl.setting()


def test_interpreter_and_cpu_launches_never_use_pdl(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "on")
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.available()
    assert pdl.launch_args() == {"PDL": False}


def _statements(fn: ast.FunctionDef) -> list:
    return [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]


def _tile_waits_before_reading(fn: ast.FunctionDef) -> bool:
    """The tile waits (``pdl_enter(PDL)``), and nothing before the wait touches an input other than the weights."""
    body = [ast.unparse(s) for s in _statements(fn)]
    if "pdl_enter(PDL)" not in body:
        return False
    before = body[:body.index("pdl_enter(PDL)")]
    return not any(name in line for line in before for name in OUTPUT_OF_EARLIER_KERNELS)


def _kernels_and_launches(path: Path):
    tree = ast.parse(path.read_text())
    kernels, functions = {}, {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for name, node in functions.items():
        if name.startswith("_") and name.endswith("_kernel"):
            body = _statements(node)
            waits_first = bool(body) and ast.unparse(body[0]) == "pdl_enter(PDL)"
            if name in WAITS_IN_TILE:
                waits_first = "PDL" in ast.unparse(body[0]) and _tile_waits_before_reading(functions[WAITS_IN_TILE[name]])
            kernels[name] = ("PDL" in [a.arg for a in node.args.args], waits_first)
    launches = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            name = ast.unparse(node.func.value)
            if name in kernels:
                launches.setdefault(name, []).append(any(k.arg is None and "pdl.launch_args" in ast.unparse(k.value)
                                                         for k in node.keywords))
    return kernels, launches


def test_every_triton_kernel_waits_first_and_every_launch_passes_the_setting():
    seen = 0
    for path in sorted(KERNEL_DIR.glob("*_triton.py")):
        kernels, launches = _kernels_and_launches(path)
        for name, (takes, waits_first) in kernels.items():
            if name in WITHOUT_PDL:
                assert not takes, f"{path.name}: {name} must not take PDL"
                continue
            seen += 1
            assert takes and waits_first, f"{path.name}: {name} must take PDL and call pdl_enter(PDL) first"
            assert launches.get(name) and all(launches[name]), f"{path.name}: a launch of {name} lacks pdl.launch_args"
    assert seen >= 15
