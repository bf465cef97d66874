"""The exact SSM kernels, as the CPU tests launch them, compile for an H100 (sm_90a) with every name their loops
assign carried through the loop (``bench/kernel_precheck.py``: Triton's front end, not the interpreter, on the CPU).
The test fails on the tree walk that lost its parent's state on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_exact_ssm_kernels_compile_for_sm90_with_every_loop_name_carried(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    report = tmp_path / "precheck.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench/kernel_precheck.py", str(report),
                           "tests/kernels/test_kernels_exact_ssm.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    text = report.read_text() if report.exists() else ""
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:], text[-3000:])
    lines = text.splitlines()
    assert "rc 0" in lines[0] and len(lines) > 5, text
    assert {"_tree_walk_kernel", "_mamba_step_kernel", "_replay_kernel", "_tree_conv_kernel"} <= {
        line.split(" ")[1].split(".")[-1] for line in lines[1:]}, text
