"""Kernels launched per Mamba2 mixer call on each path (step / tree / commit), counted on the CPU.

Aten ops that launch device work are counted with a ``TorchDispatchMode`` (views, splits and
allocations launch nothing and are skipped); Triton kernels are counted at their launch (run
under ``TRITON_INTERPRET=1`` on the CPU). Used by ``stree bench kernels`` and its tests.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stree.kernels import backend

# Aten ops that only make views, metadata or uninitialised memory: no kernel runs for them.
_NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "unsqueeze",
    "squeeze", "expand", "as_strided", "t", "transpose", "permute", "detach", "alias", "empty",
    "empty_like", "empty_strided", "new_empty", "lift_fresh", "_to_copy_noop", "unbind", "narrow",
}


class _AtenCounter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts
        self.inside_triton = 0  # the interpreter's own tensor work inside a Triton launch is not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_LAUNCH and not self.inside_triton:
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches():
    """Yields a Counter filled with ``aten.<op>`` and ``triton.<kernel>`` launches made inside."""
    counts: Counter = Counter()
    mode = _AtenCounter(counts)
    patched = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        for cls in (InterpretedFunction, JITFunction):
            orig = cls.run

            def run(self, *args, _orig=orig, **kwargs):
                if not kwargs.get("warmup", False) and not mode.inside_triton:
                    counts[f"triton.{getattr(self, '__name__', None) or self.fn.__name__}"] += 1
                mode.inside_triton += 1
                try:
                    return _orig(self, *args, **kwargs)
                finally:
                    mode.inside_triton -= 1

            cls.run = run
            patched.append((cls, orig))
    except ImportError:
        pass
    try:
        with mode:
            yield counts
    finally:
        for cls, orig in patched:
            cls.run = orig


def mixer_launches(mixer, batch: int = 1, nodes: int = 8, which: str = "torch") -> dict[str, int]:
    """Launches per call of ``mixer.step``, ``tree`` (a chain of ``nodes``) and ``commit`` on backend ``which``
    (on the mixer's device: a GPU, or the CPU with ``TRITON_INTERPRET=1`` for Triton)."""
    dev = mixer.in_proj.weight.device
    parents = torch.arange(-1, nodes - 1, device=dev).repeat(batch, 1)
    path = torch.arange(nodes, device=dev).repeat(batch, 1)
    path_len = torch.full((batch,), nodes // 2, device=dev)
    out = {}
    backend.use(which)
    try:
        with torch.no_grad():
            state = mixer.new_state(batch, dev, torch.float32)
            u1 = torch.randn(batch, mixer.d_model, device=dev)
            un = torch.randn(batch, nodes, mixer.d_model, device=dev)
            with count_launches() as c:
                mixer.step(u1, state)
            out["step"] = sum(c.values())
            with count_launches() as c:
                _, acts = mixer.tree(un, state, parents)
            out["tree"] = sum(c.values())
            with count_launches() as c:
                mixer.commit(state, acts, path, path_len)
            out["commit"] = sum(c.values())
    finally:
        backend.use(None)
    return out
