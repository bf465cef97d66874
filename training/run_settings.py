"""How a training phase runs, as opposed to what it learns: speed options, checkpoints, data workers; and the
helpers every phase shares (autocast, compact checkpoints, the phase's log)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from stree.verifier.model.checkpoint import save_model

from stree.training.distributed import DistEnv
from stree.training.loop import PhaseConfig, PhaseResult


@dataclass
class RunSettings:
    """How a phase runs (not what it learns): speed options, checkpoints, data workers."""

    compile: bool = False  # torch.compile the pieces around the SSD kernels
    recompute: bool = False  # activation checkpointing per block (less memory, a third more compute)
    micro_batch: Optional[int] = None  # rows per micro-batch on each rank (None: the rank's whole share)
    cuda_graphs: bool = True
    resume: bool = False
    save_every: int = 0
    workers: Optional[int] = None  # tokenizer processes (None: every CPU)
    peak_tflops: Optional[float] = None  # per card, for MFU (None: from the card's name)

    def eval_rows(self, env: DistEnv, batch_size: int) -> int:
        """Windows per validation batch: a micro-batch (evaluation holds no more activations than training)."""
        return self.micro_batch or max(1, batch_size // env.world_size)

    def phase(self, env: DistEnv, batch_size: int, seq_len: int, **kw) -> PhaseConfig:
        """A ``PhaseConfig`` with these settings for a global batch of ``batch_size`` windows."""
        per_rank = batch_size // env.world_size
        micro = self.micro_batch or per_rank
        if per_rank % micro:
            raise ValueError(f"micro batch {micro} does not divide the {per_rank} rows each of "
                             f"{env.world_size} processes gets of batch {batch_size}")
        return PhaseConfig(micro_batches=per_rank // micro, tokens_per_step=batch_size * seq_len,
                           cuda_graphs=self.cuda_graphs and not self.compile, resume=self.resume,
                           save_every=self.save_every,
                           peak_flops=None if self.peak_tflops is None else self.peak_tflops * 1e12, **kw)


def autocast(device):
    """bf16 autocast on CUDA, nothing elsewhere."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def compact_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy with matrices in bf16 and vectors (A_log, dt_bias, D, norms, biases) in fp32: small checkpoints."""
    clone = copy.deepcopy(model).cpu()
    with torch.no_grad():
        for p in clone.parameters():
            if p.dim() >= 2:
                p.data = p.data.to(torch.bfloat16)
    return clone


def save_compact(model: torch.nn.Module, out_dir: Path, tokenizer=None) -> Path:
    """``save_model`` of ``compact_copy(model)``."""
    return save_model(compact_copy(model), out_dir, tokenizer)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def phase_log(res: PhaseResult, tokens_per_step: int, flops_per_token: float = 0.0) -> dict:
    return {"steps": res.steps, "seconds": round(res.seconds, 1), "step_ms": round(res.step_ms, 2),
            "tokens_seen": res.steps * tokens_per_step, "tokens_per_s": res.tokens_per_s and round(res.tokens_per_s),
            "mfu": res.mfu and round(res.mfu, 4), "flops_per_token": flops_per_token, "cuda_graph": res.graphed,
            "resumed_from": res.resumed_from, "note": res.note,
            "loss": [(s, round(v, 4)) for s, v in res.losses],
            "evals": [(s, {k: round(v, 4) for k, v in m.items()}) for s, m in res.evals]}
