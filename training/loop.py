"""One training phase: AdamW, linear warm-up then cosine LR, gradient clipping, bf16 autocast on CUDA,
data-parallel over torchrun's processes (DDP), gradient accumulation, periodic validation, resumable checkpoints.

Every step trains on one global batch (``next_batch(step)`` gives this rank's rows of it), split into
micro-batches whose gradients add up; DDP averages them over ranks, so the update does not depend on how many
processes share the batch. A single process on CUDA with one micro-batch captures the whole step (forward,
backward, clipping, optimizer) in a CUDA graph, since a small model's step is otherwise bound by kernel launches;
it falls back to eager steps if capture fails. A wall-clock cap shortens the schedule up front (measured on the
first steps; rank 0's count is everyone's). With ``checkpoint`` set, the trained module, the optimizer and the
logs are saved every ``save_every`` steps and at the end, and ``resume`` continues from there (batches are drawn
by step, so a resumed run sees what an uninterrupted one would).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from stree.kernels.cuda_graph import capture_graph

from stree.training.distributed import DistEnv
from stree.training.flops import mfu

PROBE_STEPS = 8  # steps timed before the schedule length is fixed under a time cap


def lr_at(step: int, total: int, warmup: int, base: float, min_ratio: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio * base`` at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def mark_params_changed(module: torch.nn.Module) -> None:
    """Bump every parameter's version counter: graph replays change weights without doing so,
    and modules cache values derived from weights (e.g. Mamba2's ``A``) by version."""
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1)


@dataclass
class PhaseResult:
    steps: int
    seconds: float
    step_ms: float
    graphed: bool
    losses: list = field(default_factory=list)  # (step, loss)
    evals: list = field(default_factory=list)  # (step, metrics dict)
    note: str = ""
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    resumed_from: int = 0


@dataclass
class PhaseConfig:
    steps: int
    lr: float
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1
    max_seconds: Optional[float] = None
    eval_every: int = 200
    cuda_graphs: bool = True
    desc: str = "train"
    micro_batches: int = 1  # gradient accumulation: this rank's rows are split into this many micro-batches
    tokens_per_step: int = 0  # global tokens per step (for tokens/s)
    flops_per_token: float = 0.0  # model FLOPs per trained token (for MFU; 0: not reported)
    peak_flops: Optional[float] = None  # per card; None: from the card's name
    checkpoint: Optional[str] = None  # resume file of this phase
    save_every: int = 0  # steps between resume saves, and one at the end (0: none)
    resume: bool = False


class Objective(torch.nn.Module):
    """What DDP wraps: the trained module, and a loss of it on a batch (frozen models stay outside)."""

    def __init__(self, trained: torch.nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.trained = trained
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(x)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class _Stepper:
    """Runs one optimisation step on this rank's rows of a batch; eager, or replaying a captured CUDA graph."""

    def __init__(self, model, loss_fn: Callable[[torch.Tensor], torch.Tensor], cfg: PhaseConfig, env: DistEnv):
        self.model, self.cfg, self.env = model, cfg, env
        self.cuda = env.device.type == "cuda"
        self.objective = Objective(model, loss_fn)
        self.run = self.objective
        if env.active:
            self.run = DistributedDataParallel(self.objective, device_ids=[env.device] if self.cuda else None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.want_graph = self.cuda and cfg.cuda_graphs and not env.active and cfg.micro_batches == 1
        groups = _param_groups(model, cfg.weight_decay)
        if self.want_graph:
            self.lr = torch.tensor(cfg.lr, device=env.device)
            self.opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), capturable=True, foreach=True)
        else:
            self.lr = cfg.lr
            self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True if self.cuda else None)
        self.graph = None
        self.static_x = None
        self.static_loss = None
        self.note = ""

    def load_optimizer(self, state: dict) -> None:
        """A saved optimizer state; a graphed step keeps reading its learning rate from ``self.lr``."""
        self.opt.load_state_dict(state)
        if torch.is_tensor(self.lr):
            for g in self.opt.param_groups:
                g["lr"] = self.lr

    def _set_lr(self, value: float) -> None:
        if torch.is_tensor(self.lr):
            self.lr.fill_(value)
        else:
            for g in self.opt.param_groups:
                g["lr"] = value

    def _loss(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                return self.run(x)
        return self.run(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=False)
        parts = x.chunk(self.cfg.micro_batches) if self.cfg.micro_batches > 1 else (x,)
        total = None
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            sync_off = self.env.active and not last
            with self.run.no_sync() if sync_off else contextlib.nullcontext():
                loss = self._loss(part)
                (loss / len(parts)).backward()
            total = loss.detach() if total is None else total + loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=self.cuda or None)
        self.opt.step()
        return total / len(parts)

    def _capture(self, x: torch.Tensor) -> None:
        """Warm up on a side stream (these are real steps), then capture one step."""
        self.static_x = x.clone()
        self.graph, self.static_loss = capture_graph(lambda: self._body(self.static_x), warmup=2)

    def step(self, x: torch.Tensor, lr: float) -> torch.Tensor:
        self._set_lr(lr)
        if self.want_graph and self.graph is None:
            try:
                self._capture(x)
            except Exception as exc:  # noqa: BLE001 - a capture failure costs speed only
                self.want_graph = False
                self.graph = None
                self.note = f"CUDA graph capture failed ({type(exc).__name__}: {exc}); eager steps"
                torch.cuda.synchronize()
                print(self.note, flush=True)
        if self.graph is not None:
            self.static_x.copy_(x)
            self.graph.replay()
            return self.static_loss.clone()
        return self._body(x)


def _save(path: Path, stepper: _Stepper, step: int, total: int, result: PhaseResult, train_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": stepper.model.state_dict(), "opt": stepper.opt.state_dict(), "step": step, "total": total,
                "losses": result.losses, "evals": result.evals, "note": result.note, "train_s": train_s}, tmp)
    tmp.replace(path)


def run_phase(model, loss_fn, next_batch: Callable[[int], torch.Tensor], cfg: PhaseConfig,
              env: DistEnv | str | torch.device, evaluate: Optional[Callable[[], dict]] = None) -> PhaseResult:
    """Train ``model`` on ``loss_fn(next_batch(step))`` for ``cfg.steps`` steps (fewer under ``max_seconds``).

    ``env`` is this process's ``DistEnv`` (or a device, for one process); ``evaluate`` runs on every rank (it may
    reduce over ranks itself) with the model in eval mode."""
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    if not isinstance(env, DistEnv):
        env = DistEnv(device=torch.device(env))
    model.train()
    stepper = _Stepper(model, loss_fn, cfg, env)
    sync = (lambda: torch.cuda.synchronize()) if stepper.cuda else (lambda: None)
    total, warmup = cfg.steps, min(cfg.warmup, max(1, cfg.steps // 10))
    result = PhaseResult(steps=0, seconds=0.0, step_ms=0.0, graphed=False)
    step, train_before = 0, 0.0
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
    if ckpt is not None and cfg.resume and ckpt.exists():
        saved = torch.load(ckpt, map_location=env.device, weights_only=False)
        model.load_state_dict(saved["model"])
        stepper.load_optimizer(saved["opt"])
        step, total, train_before = saved["step"], saved["total"], saved.get("train_s", 0.0)
        result.losses, result.evals, result.note = saved["losses"], saved["evals"], saved["note"]
        result.resumed_from = step
        if env.is_main:
            print(f"{cfg.desc}: resumed at step {step} of {total} from {ckpt}", flush=True)
    pending: list[tuple[int, torch.Tensor]] = []
    start = time.perf_counter()
    aside_s, timed_from, timed_t0 = 0.0, None, None
    bar = tqdm(total=total, initial=step, desc=cfg.desc, dynamic_ncols=True, mininterval=2.0,
               disable=not env.is_main)
    first = step
    while step < total:
        loss = stepper.step(next_batch(step), lr_at(step, total, warmup, cfg.lr, cfg.min_lr_ratio))
        pending.append((step, env.mean_async(loss)))
        step += 1
        bar.update(1)
        if step == first + 2 or (timed_from is None and step == total):
            sync()
            timed_from, timed_t0, aside_s = step, time.perf_counter(), 0.0
        if cfg.max_seconds is not None and step == first + 2 + PROBE_STEPS and step < total:
            sync()
            per_step = (time.perf_counter() - timed_t0) / PROBE_STEPS
            left = cfg.max_seconds - (time.perf_counter() - start) - train_before
            fits = env.broadcast_int(step + max(0, int(left / per_step)))
            if fits < total:
                result.note = f"schedule cut from {total} to {fits} steps to fit {cfg.max_seconds:.0f}s"
                total = fits
                bar.total = total
                bar.refresh()
        saving = ckpt is not None and env.is_main and cfg.save_every and (step == total or step % cfg.save_every == 0)
        if len(pending) >= 25 or step == total or saving:
            sync()
            result.losses.extend((s, float(v)) for s, v in pending)
            pending = []
            bar.set_postfix(loss=f"{result.losses[-1][1]:.3f}")
        if evaluate is not None and (step % cfg.eval_every == 0 or step == total):
            t0 = time.perf_counter()
            mark_params_changed(model)
            model.eval()
            result.evals.append((step, evaluate()))
            model.train()
            aside_s += time.perf_counter() - t0
            if env.is_main:
                metrics = result.evals[-1][1].items()
                bar.write(f"{cfg.desc} step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics))
        if saving:
            t0 = time.perf_counter()
            _save(ckpt, stepper, step, total, result, train_before + t0 - start)
            aside_s += time.perf_counter() - t0
    bar.close()
    sync()
    end = time.perf_counter()
    mark_params_changed(model)
    model.eval()
    result.steps = step
    result.seconds = train_before + end - start
    result.step_ms = 1e3 * (end - start) / max(1, step - first)
    result.graphed = stepper.graph is not None
    result.note = "; ".join(n for n in (result.note, stepper.note) if n)
    if timed_from is not None and step > timed_from and cfg.tokens_per_step:
        timed = end - timed_t0 - aside_s
        result.tokens_per_s = (step - timed_from) * cfg.tokens_per_step / max(timed, 1e-9)
        if cfg.flops_per_token:
            result.mfu = mfu(result.tokens_per_s * cfg.flops_per_token, env.device, env.world_size, cfg.peak_flops)
    env.barrier()
    return result
