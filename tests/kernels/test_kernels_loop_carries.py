"""Loop-carried values in Triton kernels: what the compiled kernel carries must be what Python would carry.

Triton's front end visits a loop body once and carries a name only if that pass gave it a new value. A plain copy
``a = b`` of a value the loop has not changed yet (``b`` bound before the loop, and ``a`` too) leaves ``a``'s value
as it was in that pass, so ``a`` is not carried and every iteration reads its value from before the loop, while the
interpreter (``TRITON_INTERPRET=1``, the CPU tests) follows Python and carries it. The exact tree walk had that bug:
a node resuming from its parent's state resumed from the committed state on the GPU only. Two checks, both on the
CPU: no kernel loop copies such a value (source scan), and the tree walk's compiled loop carries both states it must
(the front end's IR for sm_90, built without a GPU).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIRS = ("kernels", "drafter_service", "verifier")


def _assigned(stmts) -> set[str]:
    out = set()
    for st in stmts:
        for n in ast.walk(st):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
            for t in targets:
                out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def _is_static(loop) -> bool:
    return isinstance(loop, ast.For) and ast.unparse(loop.iter).startswith(("tl.static_range", "static_range"))


def _copies_in_loop(loop, bound: set[str]) -> list[tuple[int, str]]:
    """``a = b`` statements of ``loop``'s body (nested ifs included) with ``a`` bound before the loop and ``b`` not
    yet assigned in this iteration: ``a`` would not be carried."""
    found, assigned = [], set()

    def scan(stmts):
        for st in stmts:
            if (isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                    and isinstance(st.value, ast.Name) and st.targets[0].id in bound
                    and st.value.id not in assigned and st.value.id in bound):
                found.append((st.lineno, f"{st.targets[0].id} = {st.value.id}"))
            if isinstance(st, ast.If):
                scan(st.body)
                scan(st.orelse)
            elif isinstance(st, (ast.For, ast.While)) and not _is_static(st):
                scan(st.body)  # an inner loop's copies are checked as its own loop too
            assigned.update(_assigned([st]))

    scan(loop.body)
    return found


def uncarried_copies(source: str) -> list[str]:
    """Every ``line: function: a = b`` of ``source``'s ``@triton.jit`` functions that Triton would not carry."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue

        def visit(stmts, bound):
            bound = set(bound)
            for st in stmts:
                if isinstance(st, (ast.For, ast.While)) and not _is_static(st):
                    inner = bound | ({st.target.id} if isinstance(st, ast.For) and isinstance(st.target, ast.Name)
                                     else set())
                    out.extend(f"{line}: {fn.name}: {what}" for line, what in _copies_in_loop(st, bound))
                    visit(st.body, inner)
                elif isinstance(st, ast.If):
                    visit(st.body, bound)
                    visit(st.orelse, bound)
                elif isinstance(st, ast.For):
                    visit(st.body, bound)
                bound |= _assigned([st])

        visit(fn.body, {a.arg for a in fn.args.args})
    return out


def _kernel_sources():
    for folder in KERNEL_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if "@triton.jit" in text:
                yield path, text


def test_no_kernel_loop_copies_a_value_triton_would_not_carry():
    bad = [f"{p.relative_to(ROOT)}:{hit}" for p, text in _kernel_sources() for hit in uncarried_copies(text)]
    assert not bad, "loop copies Triton's front end does not carry (give the name a new value instead):\n" + \
        "\n".join(bad)


def test_the_scan_finds_the_copy_that_broke_the_tree_walk():
    planted = '''
@triton.jit
def walk(h0, n):
    cur = h0
    sib = h0
    for i in range(0, n):
        state = cur
        parent = state
        for m in range(0, i):
            parent = state
            state = step(state)
        sib = parent
        cur = state
'''
    assert [hit.split(": ", 2)[2] for hit in uncarried_copies(planted)] == ["parent = state"]


_WALK_IR = """
import json, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from stree.kernels.ssm_walk_triton import _tree_walk_kernel as k

const = {"NP": 16, "BP": 16, "BS": 64, "D_PER_CHANNEL": False, "IS_CHAIN": False, "PDL": False}
sig = {n: "constexpr" if n in const else "*i64" if n == "par_ptr" else "*fp32" if n.endswith("_ptr") else "i32"
       for n in k.arg_names}
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
opts = backend.parse_options({"num_warps": 4, "enable_fp_fusion": False})
ctx = ir.context()
ir.load_dialects(ctx)
backend.load_dialects(ctx)
src = ASTSource(k, sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()})
sys.stdout.write(str(src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(),
                                 ctx)))
"""


def test_the_compiled_tree_walk_carries_the_current_and_the_parent_state():
    """The tree walk's IR for an H100, built on the CPU (the compiler, not the interpreter: a fresh process
    without ``TRITON_INTERPRET``): its node loop carries two states."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _WALK_IR], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    walk = proc.stdout[proc.stdout.index("@stree.kernels.ssm_walk_triton._walk_tree"):]
    node_loop = re.search(r"scf\.for %k = [^\n]*? iter_args\((.*?)\) -> \((.*?)\)", walk)
    assert node_loop is not None, walk[:2000]
    # cur and sib (two states), cur_node and sib_node
    assert node_loop.group(2) == "tensor<16x64xf32>, tensor<16x64xf32>, i32, i32", node_loop.group(0)
