"""Train a target/drafter pair from scratch: a hybrid Mamba2+attention target LM, then a Mamba2 drafter distilled
from it (the demo pair in git, and the benchmark pair at scale).

The drafter learns KL(target || draft) on the target's softmax over the training text (as the STree authors
trained theirs). Both share one byte-level BPE tokenizer trained on the corpus. Checkpoints are written in
mamba_ssm's format with matrices in bf16, plus a JSON training log (throughput, MFU, losses, validation) and a
loss-curve PNG next to them. Runs on one process or data-parallel under torchrun (``training.distributed``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from stree.kernels import backend
from stree.verifier.model.lm import StreeLM
from stree.verifier.model.tokenizer import eos_token_id

from stree.training.corpus import DEFAULT_PACKAGES, MAX_FILE_BYTES
from stree.training.data import (WindowSampler, corpus_bpe, corpus_files, corpus_tokens, default_cache_dir,
                                 eval_windows)
from stree.training.distill import DraftSettings, draft_phase
from stree.training.distributed import DistEnv, rank_rows
from stree.training.fast_forward import TrainForward, head
from stree.training.flops import train_flops_per_token
from stree.training.loop import run_phase
from stree.training.model_shape import Shape, make_model
from stree.training.losses import linear_cross_entropy
from stree.training.ssd import ssd_backend
from stree.training.run_settings import RunSettings, autocast, dir_bytes, phase_log, save_compact

LOG_FILE, PLOT_FILE = "train_log.json", "train_loss.png"


@dataclass
class TrainConfig:
    out: str = "checkpoints"
    prefix: str = "demo"  # writes OUT/<prefix>-target and OUT/<prefix>-draft
    vocab_size: int = 8192
    # Deep and narrow: a decode step costs per layer (launch-bound at this size), so 20 layers give
    # the target a cost ratio to the 2-layer drafter closer to real target/draft pairs.
    target: Shape = field(default_factory=lambda: Shape(256, 20, (10,)))
    draft: Shape = field(default_factory=lambda: Shape(256, 2))
    target_steps: int = 2000
    draft_steps: int = 1500  # 0: no drafter
    batch_size: int = 32  # global, in windows
    seq_len: int = 512
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    target_minutes: Optional[float] = None
    draft_minutes: Optional[float] = None
    eval_every: int = 250
    eval_batches: int = 4
    packages: tuple = DEFAULT_PACKAGES
    corpus_bytes: int = 24_000_000
    max_file_bytes: int = MAX_FILE_BYTES
    tokenizer_bytes: int = 8_000_000
    val_fraction: float = 0.02
    corpus_roots: Optional[list] = None
    cache_dir: Optional[str] = None  # tokenizer and token ids (default: data.default_cache_dir())
    rescale_residual: bool = False  # out_proj / sqrt(n_layer) at init (mamba_ssm's option; deep targets)
    device: str = "cpu"
    seed: int = 0
    run: RunSettings = field(default_factory=RunSettings)


def lm_loss(fwd: TrainForward, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on windows ``x`` ``[B, T+1]``."""
    w, scale = head(fwd.model)
    return linear_cross_entropy(fwd(x[:, :-1]), w, x[:, 1:], scale)


@torch.no_grad()
def eval_target(fwd: TrainForward, windows: list, env: DistEnv) -> dict:
    """Validation cross-entropy and perplexity over every rank's windows."""
    total = n = 0.0
    with autocast(env.device):
        for x in windows:
            count = x[:, 1:].numel()
            total += float(lm_loss(fwd, x)) * count
            n += count
    total, n = env.all_sum([total, n])
    loss = total / max(n, 1.0)
    return {"val_ce": loss, "val_ppl": float(np.exp(min(loss, 50.0)))}


def train_target(cfg: TrainConfig, env: DistEnv, vocab: int, sampler, windows) -> tuple[StreeLM, dict]:
    """The target phase: next-token cross-entropy from a random init."""
    target = make_model(cfg.target, vocab, cfg.seed + 1, env.device, cfg.rescale_residual)
    fwd = TrainForward(target, compile=cfg.run.compile, recompute=cfg.run.recompute)
    flops = train_flops_per_token(target, cfg.seq_len)
    phase = cfg.run.phase(env, cfg.batch_size, cfg.seq_len, steps=cfg.target_steps, lr=cfg.target_lr,
                          warmup=cfg.warmup, weight_decay=cfg.weight_decay,
                          max_seconds=None if cfg.target_minutes is None else 60 * cfg.target_minutes,
                          eval_every=cfg.eval_every, desc="target", flops_per_token=flops,
                          checkpoint=str(Path(cfg.out) / "resume" / f"{cfg.prefix}-target.pt"))
    res = run_phase(target, lambda x: lm_loss(fwd, x), sampler, phase, env,
                    evaluate=lambda: eval_target(fwd, windows, env))
    return target, phase_log(res, phase.tokens_per_step, flops)


def train_pair(cfg: TrainConfig, env: DistEnv | None = None) -> dict:
    """Build the corpus and tokenizer, train the target, distill the drafter, save both; returns the log."""
    started = time.perf_counter()
    env = env or DistEnv(device=torch.device(cfg.device))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = cfg.cache_dir or default_cache_dir()
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    files, roots = corpus_files(cfg.packages, cfg.corpus_roots, cfg.seed, cfg.val_fraction, cfg.max_file_bytes)
    tokenizer = corpus_bpe(files, cfg.vocab_size, cfg.tokenizer_bytes, cache, env)
    vocab, eos = tokenizer.get_vocab_size(), eos_token_id(tokenizer)
    tokens = corpus_tokens(files, tokenizer, eos, cfg.corpus_bytes, cache, env, cfg.run.workers)
    data_s = time.perf_counter() - t0
    if env.is_main:
        print(f"corpus: {tokens.meta['train_files']} train / {tokens.meta['val_files']} val files, "
              f"{tokens.meta['bytes'] / 1e6:.1f} MB ({tokens.meta['duplicates']} duplicates dropped); vocab {vocab}; "
              f"{len(tokens.train)} train / {len(tokens.val)} val tokens ({data_s:.1f}s)", flush=True)
    rows = rank_rows(cfg.batch_size, env)
    sampler = WindowSampler(tokens.train, cfg.batch_size, cfg.seq_len, cfg.seed, env.device, rows)
    windows = eval_windows(tokens.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len, env.device, env,
                           cfg.run.eval_rows(env, cfg.batch_size))

    backend.use("torch")  # blocks outside the fast path run the differentiable PyTorch references
    try:
        target, t_log = train_target(cfg, env, vocab, sampler, windows)
        target.requires_grad_(False)
        draft, d_log = None, None
        if cfg.draft_steps > 0:
            draft_sampler = WindowSampler(tokens.train, cfg.batch_size, cfg.seq_len, cfg.seed + 10**7, env.device,
                                          rows)
            settings = DraftSettings(steps=cfg.draft_steps, lr=cfg.draft_lr, warmup=cfg.warmup,
                                     weight_decay=cfg.weight_decay, minutes=cfg.draft_minutes,
                                     eval_every=cfg.eval_every, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                     checkpoint=str(out / "resume" / f"{cfg.prefix}-draft.pt"))
            draft = make_model(cfg.draft, vocab, cfg.seed + 2, env.device)
            d_log = draft_phase(target, draft, draft_sampler, windows, settings, cfg.run, env)
    finally:
        backend.use(None)
    log = {
        "config": {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in vars(cfg).items()},
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "gpus": env.world_size if env.device.type == "cuda" else 0, "processes": env.world_size,
        "torch": torch.__version__, "ssd": ssd_backend(env.device), "compile": cfg.run.compile,
        "corpus": {**tokens.meta, "packages": list(cfg.packages), "roots": [str(r) for r in roots]},
        "tokenizer": {"vocab_size": vocab, "train_tokens": int(len(tokens.train)),
                      "val_tokens": int(len(tokens.val)), "seconds": round(data_s, 2)},
        "params": {"target": sum(p.numel() for p in target.parameters()),
                   "draft": sum(p.numel() for p in draft.parameters()) if draft is not None else 0},
        "target_layers": cfg.target.n_layer,
        "target": t_log,
        "draft": d_log,
    }
    if env.is_main:
        target_dir = save_compact(target, out / f"{cfg.prefix}-target", tokenizer)
        log["checkpoint_bytes"] = {"target": dir_bytes(target_dir)}
        if draft is not None:
            log["checkpoint_bytes"]["draft"] = dir_bytes(save_compact(draft, out / f"{cfg.prefix}-draft", tokenizer))
        log["seconds"] = round(time.perf_counter() - started, 1)
        (out / LOG_FILE).write_text(json.dumps(log, indent=1, default=str))
        try:
            plot_losses(log, out / PLOT_FILE)
        except ImportError as exc:  # the checkpoints and log are saved; the plot can be redrawn from the log
            print(f"no loss plot ({exc}); redraw it with `stree train --replot {out}`", flush=True)
    env.barrier()
    return log


def plot_losses(log: dict, path: Path) -> None:
    """Two panels: target cross-entropy (train, validation) and drafter KL / top-1 agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in (("target", "val_ce", "target: next-token CE"),
                          ("draft", "val_kl", "drafter: KL(target || draft)")) if log.get(p[0])]
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4), squeeze=False)
    for ax, (phase, key, label) in zip(axes[0], phases):
        steps, losses = zip(*log[phase]["loss"]) if log[phase]["loss"] else ((), ())
        ax.plot(steps, losses, lw=0.8, alpha=0.7, label="train")
        if log[phase]["evals"]:
            es, em = zip(*log[phase]["evals"])
            ax.plot(es, [m[key] for m in em], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.set_yscale("log")
        ax.legend(loc="upper right")
        if phase == "draft" and log[phase]["evals"]:
            twin = ax.twinx()
            twin.plot(es, [m["val_top1_agreement"] for m in em], "s--", color="tab:green", label="top-1 agreement")
            twin.set_ylim(0, 1)
            twin.set_ylabel("validation top-1 agreement with target")
    fig.suptitle(f"target {log['params']['target'] / 1e6:.1f}M, draft {log['params']['draft'] / 1e6:.1f}M params "
                 f"({log['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
