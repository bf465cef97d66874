"""Prefill of sequences joining a slot pool, each chunk one CUDA-graph replay at a (rows, width) bucket.

An eager prefill pass of the 20-layer demo target is about 300 kernel launches: measured on the H100
it took 25-38 ms of host time against 5.8 ms of GPU work, paid at every admission and at every
refresh of a stale drafter. ``PrefillRunner`` prefills into a scratch state of its own whose rows are
padded to a power of two (at most ``MAX_ROWS``) and whose chunks are padded to ``bucket_width``, so
a few graphs, each captured once, serve every batch of contexts. Contexts run longest first (the
rows still going are a prefix); a row is handed over as soon as its context ends, because the chunks
after that may run it as row padding and overwrite it.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from stree.kernels.cuda_graph import capture_graph
from stree.verifier.model.batch_prefill import bucket_width, next_power_of_two, pack_ids, prefill_buckets
from stree.verifier.model.lm import LMState

log = logging.getLogger(__name__)

MAX_ROWS = 16
"""Most contexts prefilled together (more run in groups): the scratch state holds this many rows."""

# deliver(context indices, first scratch row, final-norm hidden [rows, d]): rows first..first+len-1 hold
# those contexts' states, in the runner's scratch (copy them out before the next pass overwrites them)
Deliver = Callable[[list, int, torch.Tensor], None]


def _is_cache(name: str) -> bool:
    """KV caches are read only below a row's length, so a reset or a capture leaves them as they are."""
    return name.endswith("_cache")


class PrefillRunner:
    """Batched right-padded prefill of a model into a scratch state of ``max_rows`` rows x ``max_seqlen`` slots.

    ``cuda_graphs`` (default: on CUDA) replays one graph per (row bucket, width bucket); ``pad_rows``
    (default: with graphs) pads the rows to a bucket even without graphs, so CPU tests run the same path.
    """

    def __init__(self, model, max_rows: int, max_seqlen: int, chunk: int = 512,
                 cuda_graphs: Optional[bool] = None, pad_rows: Optional[bool] = None):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model = model
        self.chunk = int(chunk)
        self.max_rows = max(1, min(int(max_rows), MAX_ROWS))
        cuda = model.device.type == "cuda"
        self.use_graphs = cuda if cuda_graphs is None else bool(cuda_graphs) and cuda
        self.pad_rows = self.use_graphs if pad_rows is None else bool(pad_rows)
        self.max_seqlen = int(max_seqlen)
        self.scratch: Optional[LMState] = None  # allocated on first use
        dev = model.device
        self.ids = torch.zeros(self.max_rows, self.chunk, dtype=torch.long, device=dev)
        self.lens = torch.ones(self.max_rows, dtype=torch.long, device=dev)
        self.graphs: dict = {}
        self.failed = False
        self.pool = None

    # ----- buckets ----------------------------------------------------------------------------------
    def rows_bucket(self, rows: int) -> int:
        """The row count a pass over ``rows`` live rows runs at."""
        return min(self.max_rows, next_power_of_two(rows)) if self.pad_rows else rows

    def buckets(self) -> list[tuple[int, int]]:
        """Every (rows, width) a pass can run at: what ``warm_up`` runs once."""
        rows = sorted({self.rows_bucket(r) for r in range(1, self.max_rows + 1)})
        return [(r, w) for r in rows for w in prefill_buckets(self.chunk)]

    # ----- state ------------------------------------------------------------------------------------
    def _state(self) -> LMState:
        if self.scratch is None:
            self.scratch = self.model.new_state(self.max_rows, self.max_seqlen)
        return self.scratch

    def _recurrent(self, state: LMState) -> list[torch.Tensor]:
        """The tensors a pass changes other than KV caches (whose slots past a row's length nobody reads)."""
        out = [state.seqlen]
        for layer in state.layers:
            out += [t for name, t in vars(layer).items() if not _is_cache(name)]
        return out

    def _reset(self, rows: int) -> None:
        for t in self._recurrent(self._state().rows(rows)):
            t.zero_()

    # ----- one pass ---------------------------------------------------------------------------------
    def _pass(self, rows: int, width: int) -> torch.Tensor:
        """Prefill ``self.ids[:rows, :width]`` (``self.lens[:rows]`` real tokens per row) into the scratch rows."""
        ids, lens, state = self.ids[:rows, :width], self.lens[:rows], self._state().rows(rows)

        def run():
            return self.model.prefill_padded(ids, lens, state, return_hidden=True)[1]

        if not self.use_graphs or self.failed:
            return run()
        entry = self.graphs.get((rows, width))
        if entry is None:
            entry = self._capture(run, state)
            if entry is None:
                return run()
            self.graphs[(rows, width)] = entry
        entry[0].replay()
        return entry[1]

    def _capture(self, run, state: LMState):
        """Capture ``run``; its warm-up runs advance the rows, which are put back (mid-prefill captures too)."""
        saved = [t.clone() for t in self._recurrent(state)]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        try:
            return capture_graph(run, warmup=2, pool=self.pool)
        except Exception as exc:  # noqa: BLE001 - a capture failure costs speed, never output
            log.warning("prefill graph capture failed (%r); prefilling eagerly from now on", exc)
            self.failed = True
            return None
        finally:
            for t, s in zip(self._recurrent(state), saved):
                t.copy_(s)

    def warm_up(self) -> None:
        """One pass at every (rows, width) bucket that fits: every kernel compiled and, with graphs, every
        graph captured now, so that no admission waits on either."""
        for rows, width in self.buckets():
            if width <= self.max_seqlen:
                self.run([[0] * width] * rows, lambda *_: None)

    # ----- whole contexts ---------------------------------------------------------------------------
    def run(self, contexts: Sequence[Sequence[int]], deliver: Deliver,
            keep_going: Optional[Callable[[], bool]] = None) -> bool:
        """Prefill ``contexts`` (token id lists, empty allowed), handing each to ``deliver`` when it ends.

        ``keep_going`` is asked before every pass; False (every requester went away) stops the run and
        returns False. Contexts may hold up to ``max_seqlen`` tokens.
        """
        order = sorted(range(len(contexts)), key=lambda j: -len(contexts[j]))
        for g in range(0, len(order), self.max_rows):
            if not self._group([contexts[j] for j in order[g: g + self.max_rows]], order[g: g + self.max_rows],
                               deliver, keep_going):
                return False
        return True

    def _group(self, contexts, index: list, deliver: Deliver, keep_going) -> bool:
        lengths = [len(c) for c in contexts]
        if lengths[0] > self.max_seqlen:
            raise ValueError(f"a context of {lengths[0]} tokens is over the prefill's {self.max_seqlen} slots")
        n = len(contexts)
        self._reset(self.rows_bucket(n))
        d = self.model.config.d_model
        empty = [k for k in range(n) if lengths[k] == 0]
        if empty:  # nothing to feed: the zero state and a zero hidden state
            zeros = torch.zeros(len(empty), d, device=self.model.device, dtype=self.model.dtype)
            deliver([index[k] for k in empty], empty[0], zeros)
        if lengths[0] == 0:
            return True
        ids = pack_ids(contexts, self.rows_bucket(n), lengths[0] + self.chunk).to(self.model.device, non_blocking=True)
        for start in range(0, lengths[0], self.chunk):
            if keep_going is not None and not keep_going():
                return False
            active = sum(1 for m in lengths if m > start)
            rows = self.rows_bucket(active)
            width = min(self.chunk, lengths[0] - start)
            padded = bucket_width(width, self.chunk)
            # live rows get their next tokens; padding rows (finished or unused) one throw-away token from slot 0
            seg = [min(m - start, width) for m in lengths[:active]] + [1] * (rows - active)
            self.lens[:rows].copy_(torch.tensor(seg, dtype=torch.long), non_blocking=True)
            self.ids[:rows, :padded].copy_(ids[:rows, start: start + padded])
            if rows > active:
                self._state().seqlen[active:rows].zero_()
            hidden = self._pass(rows, padded)
            ending = [k for k in range(active) if lengths[k] <= start + width]
            if ending:  # a suffix of the live rows
                deliver([index[k] for k in ending], ending[0], hidden[ending[0]: active])
        return True
