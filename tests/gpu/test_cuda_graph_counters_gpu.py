"""GPU: split-K GEMMs and decode steps captured in several CUDA graphs, replayed in any order, give the eager bits
(the arrival counters they share are zeroed before any capture, never inside one); garbage that owns a graph is
not collected mid-capture."""

from __future__ import annotations

import pytest
import torch

from stree.kernels.cuda_graph import capture_graph
from stree.kernels.gemm_triton import gemm_config, gemm_triton, sm_count

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_gemm_graphs_replayed_in_any_order_equal_eager(dtype):
    torch.manual_seed(0)
    w = torch.randn(1000, 1024, device="cuda", dtype=dtype)  # few output columns: split K
    assert gemm_config(1000, 1024, dtype, sm_count(torch.cuda.current_device()))["split_k"] > 1
    inputs = [torch.randn(m, 1024, device="cuda", dtype=dtype) for m in (1, 5, 64, 300)]
    want = [gemm_triton(x, w) for x in inputs]
    graphs = [capture_graph(lambda x=x: gemm_triton(x, w), warmup=1) for x in inputs]
    for _ in range(3):
        for k in (3, 1, 0, 2):  # replayed in another order than captured, several times
            graph, out = graphs[k]
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want[k])


def test_capture_survives_garbage_that_owns_a_graph():
    """An unreachable cycle holding a captured graph, and a collector set to run at every allocation: capturing
    another graph must not collect it mid-capture (its destructor's CUDA call would abort the process)."""
    import gc

    w = torch.randn(256, 256, device="cuda")

    class Holder:
        pass

    old = Holder()
    old.graph, old.out = capture_graph(lambda: w @ w)
    old.me = old  # a cycle: only the cyclic collector frees it
    del old
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graph, out = capture_graph(lambda: [torch.relu(w @ w + i) for i in range(50)][-1])
    finally:
        gc.set_threshold(*threshold)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.relu(w @ w + 49))
