"""The kernel backend switch: STREE_KERNELS / backend.use pick Triton kernels or the PyTorch references."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_trees import padded_batch, rel_err  # noqa: E402
from stree.kernels import backend, ops  # noqa: E402
from stree.kernels.tree_scan import tree_scan_ref  # noqa: E402


@pytest.fixture(autouse=True)
def _reset_backend():
    backend.use(None)
    yield
    backend.use(None)


def test_torch_forces_references(monkeypatch):
    monkeypatch.setenv("STREE_KERNELS", "torch")
    assert backend.resolve("cpu") == "torch"
    assert backend.resolve("cuda") == "torch"
    assert ops.get("tree_scan", torch.device("cpu")) is tree_scan_ref


def test_auto_is_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("STREE_KERNELS", "auto")
    assert backend.resolve("cpu") == "torch"
    assert backend.resolve("cuda") == "triton"


def test_triton_routes_every_op_to_its_kernel(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("STREE_KERNELS", "triton")
    for op, (_, tri) in ops._OPS.items():
        fn = ops.get(op, torch.device("cpu"))
        assert fn.__name__ == tri.split(":")[1], f"{op} fell back to {fn.__name__}"


def test_ops_call_through_triton_matches_reference(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("STREE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    parents = padded_batch([("bushy", 9), ("chain", 3)], gen)
    b, n = parents.shape
    args = (torch.randn(b, n, 2, 8, generator=gen), torch.rand(b, n, 2, generator=gen), -torch.rand(2, generator=gen),
            torch.randn(b, n, 1, 8, generator=gen), torch.randn(b, n, 1, 8, generator=gen),
            torch.randn(2, generator=gen), parents, torch.randn(b, 2, 8, 8, generator=gen))
    assert rel_err(ops.tree_scan(*args), tree_scan_ref(*args)) < 1e-5


def test_unknown_backend_is_a_value_error(monkeypatch):
    monkeypatch.setenv("STREE_KERNELS", "cuda-graphs")
    with pytest.raises(ValueError, match="STREE_KERNELS"):
        backend.resolve("cpu")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        backend.use("fast")
