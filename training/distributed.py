"""Data-parallel training over processes started by ``torchrun`` (``torch.distributed.run``): one per GPU.

``DistEnv.from_env`` reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by torchrun) and joins the process group
(NCCL on CUDA, gloo on CPU); without them it is the single process. ``relaunch`` re-runs the current command
under ``torch.distributed.run`` with N processes, so one command trains on one GPU or on all of them.
Every rank draws the same global batch and keeps its own rows of it, so a seed and a global batch give the
same loss curve on any number of processes (up to the order of floating-point sums).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @staticmethod
    def from_env(device: str | None = None) -> "DistEnv":
        """This process's place; joins the process group when launched by torchrun with more than one process.
        ``device``: ``cpu``, ``cuda`` (each rank takes ``cuda:LOCAL_RANK``) or None (CUDA when available)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        kind = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type
        dev = torch.device(kind, local) if kind == "cuda" else torch.device(kind)
        if kind == "cuda":
            torch.cuda.set_device(dev)
        if world > 1 and not dist.is_initialized():
            for key, value in SAFE_ENV.items():
                os.environ.setdefault(key, value)
            dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world,
                                    device_id=dev if kind == "cuda" else None)
        return DistEnv(rank, world, local, dev)

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks (every rank gets them)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, 0)
        return int(t.item())

    def mean_async(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar tensor over ranks, queued on the device (no host sync)."""
        if not self.active:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t / self.world_size

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def rank_rows(global_batch: int, env: DistEnv) -> slice:
    """This rank's rows of a global batch (which must split evenly)."""
    if global_batch % env.world_size:
        raise ValueError(f"batch size {global_batch} does not split over {env.world_size} processes")
    per = global_batch // env.world_size
    return slice(env.rank * per, (env.rank + 1) * per)


def relaunch(nproc: int, module: str, argv: list[str]) -> int:
    """Run ``python -m module *argv`` under ``torch.distributed.run`` with ``nproc`` local processes; its exit code."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in SAFE_ENV.items()}}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *argv]
    return subprocess.call(cmd, env=env)
