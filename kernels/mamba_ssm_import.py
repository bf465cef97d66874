"""mamba_ssm's Triton kernels without its CUDA extensions (installed from the sdist with ``MAMBA_SKIP_CUDA_BUILD``).

mamba_ssm's package import needs its Mamba1 CUDA extension ``selective_scan_cuda`` although its Mamba2 Triton
kernels do not: an empty stand-in module is registered first where the real one is missing.
"""

from __future__ import annotations

import importlib
import sys
import types


def mamba_ssm_attr(module: str, name: str):
    """``mamba_ssm.<module>.<name>`` (e.g. ``"ops.triton.ssd_combined"``, ``"mamba_chunk_scan_combined"``), or None
    where mamba_ssm (or Triton) cannot be imported."""
    try:
        if "selective_scan_cuda" not in sys.modules:
            try:
                importlib.import_module("selective_scan_cuda")
            except ImportError:
                sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
        return getattr(importlib.import_module(f"mamba_ssm.{module}"), name)
    except Exception:  # noqa: BLE001 - not installed, or installed without what it needs: the caller falls back
        return None
