"""One training phase: AdamW, linear warm-up then cosine LR, gradient clipping, bf16 autocast on CUDA.

On CUDA the whole step (forward, backward, clipping, optimizer) is captured once in a CUDA graph and
replayed, since a small model's step is otherwise bound by kernel launches; it falls back to eager
steps if capture fails. A wall-clock cap shortens the schedule up front (measured on the first steps).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from tqdm import tqdm

from stree.kernels.cuda_graph import capture_graph

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


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class _Stepper:
    """Runs one optimisation step on a batch; eager, or replaying a captured CUDA graph."""

    def __init__(self, model, loss_fn: Callable[[torch.Tensor], torch.Tensor], cfg: PhaseConfig, device):
        self.model, self.loss_fn, self.cfg, self.device = model, loss_fn, cfg, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.params = [p for p in model.parameters() if p.requires_grad]
        if self.cuda:
            self.lr = torch.tensor(cfg.lr, device=self.device)
            self.opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=self.lr, betas=(0.9, 0.95),
                                         capturable=True, foreach=True)
        else:
            self.lr = cfg.lr
            self.opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
        self.graph = None
        self.static_x = None
        self.static_loss = None
        self.want_graph = self.cuda and cfg.cuda_graphs
        self.note = ""

    def _set_lr(self, value: float) -> None:
        if self.cuda:
            self.lr.fill_(value)
        else:
            for g in self.opt.param_groups:
                g["lr"] = value

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=False)
        if self.cuda:
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                loss = self.loss_fn(x)
        else:
            loss = self.loss_fn(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=self.cuda or None)
        self.opt.step()
        return loss.detach()

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


def run_phase(model, loss_fn, next_batch: Callable[[int], torch.Tensor], cfg: PhaseConfig, device,
              evaluate: Optional[Callable[[], dict]] = None) -> PhaseResult:
    """Train ``model`` on ``loss_fn(next_batch(step))`` for ``cfg.steps`` steps (fewer under ``max_seconds``)."""
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    model.train()
    stepper = _Stepper(model, loss_fn, cfg, device)
    sync = (lambda: torch.cuda.synchronize()) if stepper.cuda else (lambda: None)
    total, warmup = cfg.steps, min(cfg.warmup, max(1, cfg.steps // 10))
    result = PhaseResult(steps=0, seconds=0.0, step_ms=0.0, graphed=False)
    pending: list[tuple[int, torch.Tensor]] = []
    start = time.perf_counter()
    probe_t0 = None
    bar = tqdm(total=total, desc=cfg.desc, dynamic_ncols=True, mininterval=2.0)
    step = 0
    while step < total:
        loss = stepper.step(next_batch(step), lr_at(step, total, warmup, cfg.lr, cfg.min_lr_ratio))
        pending.append((step, loss))
        step += 1
        bar.update(1)
        if step == 2:
            sync()
            probe_t0 = time.perf_counter()
        if cfg.max_seconds is not None and step == 2 + PROBE_STEPS and step < total:
            sync()
            per_step = (time.perf_counter() - probe_t0) / PROBE_STEPS
            left = cfg.max_seconds - (time.perf_counter() - start)
            fits = step + max(0, int(left / per_step))
            if fits < total:
                result.note = f"schedule cut from {total} to {fits} steps to fit {cfg.max_seconds:.0f}s"
                total = fits
                bar.total = total
                bar.refresh()
        if len(pending) >= 25 or step == total:
            sync()
            result.losses.extend((s, float(v)) for s, v in pending)
            pending = []
            bar.set_postfix(loss=f"{result.losses[-1][1]:.3f}")
        if evaluate is not None and (step % cfg.eval_every == 0 or step == total):
            mark_params_changed(model)
            model.eval()
            result.evals.append((step, evaluate()))
            model.train()
    bar.close()
    sync()
    mark_params_changed(model)
    model.eval()
    result.steps = step
    result.seconds = time.perf_counter() - start
    result.step_ms = 1e3 * result.seconds / max(1, step)
    result.graphed = stepper.graph is not None
    result.note = "; ".join(n for n in (result.note, stepper.note) if n)
    return result
