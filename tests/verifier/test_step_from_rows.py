"""``StreeLM.step`` from another state's rows (beams kept in place by index): row b steps ``source``'s row
``source_rows[b]`` into ``state``, which must equal gathering those rows and stepping them in place, and must leave
``source`` as it was. Only pure Mamba2 models can do it; bad rows are refused."""

from __future__ import annotations

import pytest
import torch
from device_draft_helpers import states_close

from stree.kernels import backend


def _prefilled(model, lengths, gen):
    state = model.new_state(len(lengths), 32)
    for row, n in enumerate(lengths):
        model.prefill(torch.randint(0, model.vocab_size, (1, n), generator=gen), state.rows(1, row))
    return state


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("rows", [[2, 0, 0, 1, 2], [1, 1, 0], None])
def test_step_from_source_rows_equals_gather_then_step(models, kernels, rows):
    model = models["mamba2"]
    gen = torch.Generator().manual_seed(len(rows or []) + len(kernels))
    backend.use(kernels)
    try:
        source = _prefilled(model, [3, 7, 1], gen)
        before = source.clone()
        index = torch.tensor(rows) if rows is not None else None
        gathered = source.select(index) if index is not None else source.clone()
        out = model.new_state(gathered.batch_size, 32)
        ids = torch.randint(0, model.vocab_size, (gathered.batch_size,), generator=gen)
        got = model.step(ids, out, source=source, source_rows=index)
        want = model.step(ids, gathered)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        states_close(out, gathered)  # both the recurrent states and the lengths
        states_close(source, before)  # the source is only read
        nxt = model.new_state(out.batch_size, 32)  # a stepped state is the next step's source (ping-pong)
        torch.testing.assert_close(model.step(ids, nxt, source=out), model.step(ids, gathered), atol=1e-5, rtol=1e-5)
        states_close(nxt, gathered)
    finally:
        backend.use(None)


def test_step_from_rows_refuses_what_it_cannot_do(models):
    gen = torch.Generator().manual_seed(0)
    model = models["mamba2"]
    source = _prefilled(model, [2, 4], gen)
    out = model.new_state(3, 32)
    ids = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="name rows"):
        model.step(ids, out, source=source, source_rows=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="pass source_rows"):
        model.step(ids, out, source=source)
    with pytest.raises(ValueError, match="integers"):
        model.step(ids, out, source=source, source_rows=torch.tensor([0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="another state"):
        model.step(ids[:2], source, source=source)
    hybrid = models["hybrid"]
    with pytest.raises(ValueError, match="Mamba2"):
        hybrid.step(ids, hybrid.new_state(3, 32), source=hybrid.new_state(2, 32), source_rows=torch.tensor([0, 1, 1]))
