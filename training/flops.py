"""Model FLOPs per trained token and model-FLOPs utilisation (MFU).

A token costs, in a training step (forward + backward = 3x forward):

- ``6 * P``: every matrix product with a weight, where ``P`` counts the 2-D weights the token meets (each
  Mamba2 in_proj/out_proj, attention in_proj/out_proj, MLP, and the LM head over the real vocabulary; the
  embedding lookup is free, so a tied embedding counts once, as the head). Per-channel vectors, the depthwise
  conv and the norms are left out (elementwise work), and so are routed experts (3-D weights; no trained model
  here has them).
- attention, per attention layer: ``3 * 2 * T * heads * head_dim`` (QK^T and AV, 2 FLOPs per multiply-add, a
  query sees ``(T+1)/2`` keys on average under the causal mask; ``T`` is the training sequence length).
- SSD, per Mamba2 layer, with chunk length ``Q`` (mamba_ssm's 256), ``H`` heads of size ``P``, ``N`` states,
  ``G`` groups: ``3 * (G*Q*N + H*Q*P + 4*H*N*P)``: C.B^T and the masked product with x inside the chunk (half of
  a ``Q``-square each, causal), each chunk's state from B and x, and the output read from the carried state by C.

A forward-only pass (a frozen target in distillation) costs a third of that. MFU is model FLOPs per second over
the cards' dense bf16 peak; it counts what the model needs, not recomputation (``--recompute``) or padding.
"""

from __future__ import annotations

import torch

from stree.verifier.model.lm import StreeLM
from stree.verifier.model.mamba2_mixer import Mamba2Mixer
from stree.verifier.model.attention import Attention

from stree.training.ssd import KERNEL_CHUNK

# dense bf16 tensor-core peaks (vendor datasheets, no sparsity), by a name fragment of torch.cuda.get_device_name
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12))


def matmul_params(model: StreeLM) -> int:
    """2-D weights a token meets in one forward pass (the LM head over the real vocabulary, no embedding lookup)."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embedding" not in name and not name.startswith("lm_head"):
            total += p.numel()
    return total + model.config.vocab_size * model.config.d_model


def forward_flops_per_token(model: StreeLM, seq_len: int) -> float:
    """Forward FLOPs per token at training length ``seq_len`` (see the module docstring)."""
    flops = 2.0 * matmul_params(model)
    for module in model.modules():
        if isinstance(module, Attention):
            flops += 2.0 * seq_len * module.num_heads * module.head_dim
        elif isinstance(module, Mamba2Mixer):
            q = min(KERNEL_CHUNK, seq_len)
            flops += (module.ngroups * q * module.d_state + module.nheads * q * module.headdim
                      + 4 * module.nheads * module.d_state * module.headdim)
    return flops


def train_flops_per_token(model: StreeLM, seq_len: int) -> float:
    return 3.0 * forward_flops_per_token(model, seq_len)


def peak_flops(device) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None (CPU, or a card not in ``PEAK_BF16``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def mfu(flops_per_s: float, device, world_size: int, peak: float | None = None) -> float | None:
    """Model FLOPs per second over ``world_size`` cards' peak (``peak`` per card, default ``peak_flops``)."""
    peak = peak or peak_flops(device)
    return None if not peak else flops_per_s / (peak * world_size)
