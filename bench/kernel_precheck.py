"""Check, on a machine without a GPU, what the CPU tests cannot: how every Triton kernel variant they launch
compiles for an H100 (sm_90a).

The CPU tests run the kernels in Triton's interpreter, which follows Python. The compiler does not always: its front
end carries a name through a loop only if one pass over the body gave it a new value, so a name assigned in a loop
from a value the loop had not changed yet keeps its value from before the loop on the GPU (the exact tree walk lost
its parent's state that way). This tool runs the given tests with every interpreted launch recorded (kernel, argument
types, constexprs, options), then compiles each distinct variant with the CUDA backend in a fresh process, and
reports per variant:
- names the loop bodies assign that the front end does not carry (each one a possible GPU-only bug to read);
- registers and spills (ptxas from Triton's wheel), and any compile error.
Exit 1 when a variant fails to compile or a loop leaves a name it assigns uncarried; spills are reported. An
uncarried name can be benign (its assignment sits under a constexpr branch this variant prunes): read the line.
Kernels defined in test modules are skipped.

Usage (repo root, CPU): .venv/bin/python bench/kernel_precheck.py OUT.txt [PYTEST ARGS]
   e.g. .venv/bin/python bench/kernel_precheck.py /tmp/precheck.txt tests/kernels/test_kernels_exact_ssm.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ----- phase 1: record the interpreted launches of a pytest run ----------------------------------------------------
class LaunchRecorder:
    """A pytest plugin: every ``InterpretedFunction.run`` appends its variant to ``path`` (one JSON line each)."""

    def __init__(self, path: str):
        self.path = path
        self.seen: set[str] = set()

    def pytest_configure(self, config):
        import triton.runtime.interpreter as interp

        original = interp.InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            try:
                recorder.record(fn_self, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - a variant we cannot describe is reported, not fatal
                print(f"[precheck] cannot record {fn_self.fn.__module__}.{fn_self.fn.__name__}: {exc!r}",
                      file=sys.stderr)
            return original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        interp.InterpretedFunction.run = run

    def record(self, fn_self, args, kwargs):
        import inspect

        import torch

        fn = fn_self.fn
        params = list(inspect.signature(fn).parameters.values())
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas")
                   if k in kwargs}
        kwargs.pop("launch_cooperative_grid", None)
        kwargs.pop("launch_pdl", None)
        bound = dict(zip([p.name for p in params], args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for p in params:
            value = bound.get(p.name, p.default)
            if "constexpr" in str(p.annotation):
                constexprs[p.name] = value.value if hasattr(value, "value") else value
                signature[p.name] = "constexpr"
            elif isinstance(value, torch.Tensor):
                signature[p.name] = "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                                           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
                                           torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
                                           torch.float64: "fp64"}[value.dtype]
            elif isinstance(value, bool):
                signature[p.name] = "i1"
            elif isinstance(value, int):
                signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[p.name] = "fp32"
            elif value is None:
                signature[p.name] = "constexpr"
                constexprs[p.name] = None
            else:
                raise TypeError(f"argument {p.name} of type {type(value).__name__}")
        for name, value in list(constexprs.items()):
            if isinstance(value, torch.dtype):
                constexprs[name] = str(value).removeprefix("torch.")
        entry = json.dumps({"module": fn.__module__, "name": fn.__name__, "signature": signature,
                            "constexprs": constexprs, "options": options}, sort_keys=True, default=str)
        if entry not in self.seen and fn.__module__.startswith("stree."):
            self.seen.add(entry)
            with open(self.path, "a") as f:
                f.write(entry + "\n")


# ----- phase 2: compile each variant with the CUDA backend (no interpreter) ------------------------------------------
COMPILE = r'''
import importlib, json, subprocess, sys, glob, os, re
import triton
import triton.compiler.code_generator as cg
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

uncarried = []
original = cg.CodeGenerator._find_carries

def dry_body_names(node):
    import ast
    out = set()
    for n in ast.walk(ast.Module(body=list(node.body), type_ignores=[])):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            out |= {x.id for x in ast.walk(n.target) if isinstance(x, ast.Name)}
    return out

def find_carries_checked(self, node, liveins, ignore=set()):
    names, handles, tys = original(self, node, liveins, ignore)
    assigned = dry_body_names(node)
    for name in sorted(assigned & set(liveins) - set(names) - set(ignore)):
        if cg._is_triton_value(liveins[name]):
            uncarried.append(f"line {node.lineno}: {name}")
    return names, handles, tys

cg.CodeGenerator._find_carries = find_carries_checked
ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell"))
ptxas = ptxas or glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))
v = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(v["module"]), v["name"])
names = fn.arg_names
sig = {n: v["signature"].get(n, "constexpr") for n in names}
const = {(names.index(k),): (getattr(triton.language, val) if isinstance(val, str) and hasattr(triton.language, val)
                              else val) for k, val in v["constexprs"].items() if k in names}
opts = {"enable_fp_fusion": True, **v["options"]}
c = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32), options=opts)
out = {"uncarried": sorted(set(uncarried))}
if ptxas:
    path = "/tmp/precheck-%d.ptx" % os.getpid()
    open(path, "w").write(c.asm["ptx"])
    info = subprocess.run([ptxas[0], "--gpu-name", "sm_90a", "-v", path, "-o", path + ".cubin"],
                          capture_output=True, text=True).stderr
    out["regs"] = [int(l.split("Used ")[1].split(" ")[0]) for l in info.splitlines() if "Used " in l]
    out["spill_bytes"] = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", info))
print(json.dumps(out))
'''


def compile_variant(line: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, line], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    out, pytest_args = argv[0], argv[1:] or ["tests/kernels"]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as tmp:
        launches = tmp.name
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = ("import sys; sys.path.insert(0, 'bench'); import pytest; from kernel_precheck import LaunchRecorder; "
            f"sys.exit(pytest.main({pytest_args!r} + ['-q', '-p', 'no:cacheprovider'], "
            f"plugins=[LaunchRecorder({launches!r})]))")
    rc = subprocess.call([sys.executable, "-c", code], env=env, cwd=ROOT)
    variants = [line for line in Path(launches).read_text().splitlines() if line.strip()]
    lines, bad = [f"pytest {' '.join(pytest_args)}: rc {rc}; {len(variants)} kernel variants"], 0
    for line in variants:
        v = json.loads(line)
        res = compile_variant(line)
        what = f"{v['module'].removeprefix('stree.')}.{v['name']} {json.dumps(v['constexprs'], sort_keys=True)}"
        if "error" in res:
            bad += 1
            lines.append(f"COMPILE ERROR {what}: {res['error']}")
            continue
        if res["uncarried"]:
            bad += 1
        flag = ("SPILLS " if res.get("spill_bytes") else "") + ("UNCARRIED " if res["uncarried"] else "")
        lines.append(f"{flag or 'ok '}{what}: regs {res.get('regs')}, spill bytes {res.get('spill_bytes', 0)}"
                     + (f", assigned in a loop but not carried: {res['uncarried']}" if res["uncarried"] else ""))
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:1] + [x for x in lines[1:] if not x.startswith("ok ")]))
    print(f"{len(variants)} variants, {bad} failing (compile errors or uncarried names); full list in {out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
