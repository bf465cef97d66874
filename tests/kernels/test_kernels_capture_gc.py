"""Python's cyclic collector is off while a CUDA graph captures and comes back as it was, also when the captured
call raises (a collection mid-capture can run a CUDA destructor, which aborts the process)."""

from __future__ import annotations

import gc

import pytest

from stree.kernels.cuda_graph import collector_paused


@pytest.mark.parametrize("enabled_before", [True, False])
def test_collector_is_off_inside_and_restored_after(enabled_before):
    (gc.enable if enabled_before else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError, match="captured call failed"):
            with collector_paused():
                raise RuntimeError("captured call failed")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()
