"""Children of many tree nodes at once: top-w of the logits for greedy rows, Gumbel-top-w draws from q for sampled rows.

Gumbel-top-k over ``log q`` is k successive draws without replacement from q, so sampled rows'
children are exactly what ``DraftMode.WITHOUT_REPLACEMENT`` verification assumes.
"""

from __future__ import annotations

from typing import Optional

import torch


def pick_children(logits: torch.Tensor, probs: torch.Tensor, width: int, sampled: torch.Tensor,
                  any_sampled: bool, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``[B, F, V]`` raw logits and warped ``probs`` -> ``[B, F, width]`` child tokens, grouped by parent.

    ``sampled`` (``[B, 1, 1]`` bool) marks sampled rows; ``any_sampled`` (static) says whether noise is drawn.
    """
    keys = logits.float()
    if any_sampled:
        u = torch.rand(logits.shape, device=logits.device, generator=generator).clamp_(1e-12, 1.0 - 1e-7)
        gumbel = -torch.log(-torch.log(u))
        keys = torch.where(sampled, torch.log(probs) + gumbel, keys)
    return torch.topk(keys, width, dim=-1).indices
