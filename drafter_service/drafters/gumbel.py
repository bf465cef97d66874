"""Children of many tree nodes at once: top-w of the logits for greedy rows, Gumbel-top-w draws from q for sampled rows.

Gumbel-top-k over ``log q`` is k successive draws without replacement from q, so sampled rows'
children are exactly what ``DraftMode.WITHOUT_REPLACEMENT`` verification assumes. The noise is keyed by each row's
request seed and step (``kernels.keyed_random``, lane ``DRAFT_LANE + level``): a request's draft does not depend on
what else shares the batch, and stays independent of the verifier's draws (other lanes).
"""

from __future__ import annotations

import torch

from stree.kernels import ops
from stree.kernels.keyed_random import DRAFT_LANE
from stree.protocols.sampling import RowSampling


def pick_children(logits: torch.Tensor, probs: torch.Tensor, width: int, sampled: torch.Tensor,
                  any_sampled: bool, sampling: RowSampling, level: int) -> torch.Tensor:
    """``[B, F, V]`` raw logits and warped ``probs`` -> ``[B, F, width]`` child tokens, grouped by parent.

    ``sampled`` (``[B, 1, 1]`` bool) marks sampled rows; ``any_sampled`` (static) says whether noise is drawn;
    ``sampling`` keys the noise of draft level ``level``.
    """
    keys = logits.float()
    if any_sampled:
        u = ops.keyed_uniform(sampling.seed, sampling.step, DRAFT_LANE + level, logits[0].numel())
        gumbel = -torch.log(-torch.log(u.view(logits.shape)))
        keys = torch.where(sampled, torch.log(probs) + gumbel, keys)
    return torch.topk(keys, width, dim=-1).indices
