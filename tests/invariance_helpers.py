"""Row-invariance checks shared by the CPU and GPU tests of the exact numerics.

``row_failures(fn, rows)`` computes ``fn`` on ``rows`` and then each row again alone, and inside blocks of other
rows at other offsets, and counts the rows whose result is not bit-for-bit the same. The exact ops must give 0;
the planted non-invariant GEMMs must not.
"""

from __future__ import annotations

import torch


def row_failures(fn, rows: torch.Tensor, blocks=(1, 2, 7, 16, 33), gen: torch.Generator | None = None,
                 picks: int = 3) -> int:
    """Rows of ``fn(rows)`` (rows along dim 0) that differ from the same row computed alone or inside a block of
    ``n`` (``blocks``) rows of other random data at a random offset; ``picks`` rows are checked per block size."""
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    full = fn(rows)
    m = rows.shape[0]
    bad = set()
    for n in blocks:
        for i in torch.randperm(m, generator=gen)[:picks].tolist():
            block = torch.randn((n, *rows.shape[1:]), generator=gen).to(rows.device, rows.dtype) * rows.std()
            at = int(torch.randint(0, n, (1,), generator=gen))
            block[at] = rows[i]
            if not torch.equal(fn(block)[at], full[i]):
                bad.add(i)
    return len(bad)
