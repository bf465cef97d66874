"""Distil a TreeFlash drafter from a trained target: KL to the target's next-token law at every depth.

For each position t the drafter sees the target's final-norm hidden state h_t and the root
x_{t+1}; depth k's marginal and conditional heads (the latter also given the parent x_{t+1+k})
are both fitted to the target's distribution after x_{t+1+k}. The marginal head is the ablation's
drafter and the conditional head's starting point, so both are trained together.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from stree.kernels import backend
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.lm import StreeLM
from stree.verifier.model.tokenizer import eos_token_id, load_tokenizer
from stree.verifier.model.treeflash import (
    DEFAULT_D_MODEL,
    DEFAULT_DEPTH,
    DEFAULT_N_LAYER,
    TreeFlashConfig,
    TreeFlashNet,
    save_treeflash,
)

from stree.training.corpus import DEFAULT_PACKAGES, build_corpus, tokenize
from stree.training.loop import PhaseConfig, run_phase
from stree.training.train import WindowSampler, eval_windows

TREEFLASH_DIR = "demo-treeflash"
TF_LOG_FILE, TF_PLOT_FILE = "treeflash_log.json", "treeflash_loss.png"


@dataclass
class TreeFlashTrainConfig:
    target: str = "checkpoints/demo-target"
    out: str = "checkpoints"
    d_model: int = DEFAULT_D_MODEL
    depth: int = DEFAULT_DEPTH
    n_layer: int = DEFAULT_N_LAYER
    steps: int = 2000
    minutes: float | None = None
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.0
    eval_every: int = 100
    eval_batches: int = 2
    packages: tuple = DEFAULT_PACKAGES
    corpus_bytes: int = 4_000_000
    device: str = "cpu"
    seed: int = 0
    cuda_graphs: bool = True


def depth_views(target: StreeLM, x: torch.Tensor, depth: int):
    """The target's hidden states, roots, per-depth parents and per-depth log-probs for windows ``x``.

    Returns ``hidden [P, d]``, ``roots [P]``, ``parents [P, K]``, ``target_logp [P, K, V]`` over every
    window position with K tokens after its root.
    """
    inp = x[:, :-1]
    with torch.no_grad():
        logits, hidden = target(inp, return_hidden=True)
        logp = F.log_softmax(logits.float(), -1)
    t_len = inp.shape[1]
    p = t_len - depth
    if p < 1:
        raise ValueError(f"seq_len ({t_len}) must exceed the TreeFlash depth ({depth})")
    parents = torch.stack([inp[:, 1 + k: 1 + k + p] for k in range(depth)], -1)
    t_logp = torch.stack([logp[:, 1 + k: 1 + k + p] for k in range(depth)], 2)
    v, d = logp.shape[-1], hidden.shape[-1]
    return (hidden[:, :p].reshape(-1, d).float(), parents[..., 0].reshape(-1), parents.reshape(-1, depth),
            t_logp.reshape(-1, depth, v))


def _kl(t_logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per row, averaged over the leading dims."""
    d_logp = F.log_softmax(logits, -1)
    return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()


def treeflash_losses(target: StreeLM, net: TreeFlashNet, x: torch.Tensor):
    """``(conditional KL, marginal KL, conditional logits, marginal logits, target log-probs)`` on windows ``x``."""
    hidden, roots, parents, t_logp = depth_views(target, x, net.config.depth)
    states = net.depth_states(hidden, roots)
    cond = net.conditional_logits(states, parents)
    marg = net.marginal_logits(states)
    return _kl(t_logp, cond), _kl(t_logp, marg), cond, marg, t_logp


@torch.no_grad()
def eval_treeflash(target: StreeLM, net: TreeFlashNet, windows: list) -> dict:
    """Validation KL and top-1 agreement with the target per head, and the conditional head's per depth."""
    sums: dict = {}
    for x in windows:
        kl_c, kl_m, cond, marg, t_logp = treeflash_losses(target, net, x)
        best = t_logp.argmax(-1)
        per_depth = (cond.argmax(-1) == best).float().mean(0)
        vals = {"val_kl": float(kl_c), "val_kl_marginal": float(kl_m),
                "val_top1_agreement": float(per_depth.mean()),
                "val_top1_agreement_marginal": float((marg.argmax(-1) == best).float().mean())}
        vals.update({f"val_top1_depth{k + 1}": float(a) for k, a in enumerate(per_depth)})
        for k, v in vals.items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(windows) for k, v in sums.items()}


def train_treeflash(cfg: TreeFlashTrainConfig) -> dict:
    """Distil a TreeFlash network from ``cfg.target`` on the offline corpus; saves it, its log and loss plot."""
    started = time.perf_counter()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target, device=device).eval()
    target.requires_grad_(False)
    tokenizer = load_tokenizer(cfg.target)
    if tokenizer is None:
        raise ValueError(f"{cfg.target} has no tokenizer.json: TreeFlash trains on the target's tokenization")
    corpus = build_corpus(tuple(cfg.packages), cfg.corpus_bytes, seed=cfg.seed)
    eos = eos_token_id(tokenizer)
    train_tokens, val_tokens = tokenize(tokenizer, corpus.train, eos), tokenize(tokenizer, corpus.val, eos)
    sampler = WindowSampler(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed + 3, device)
    windows = eval_windows(val_tokens, cfg.eval_batches, cfg.batch_size, cfg.seq_len, device)
    net = TreeFlashNet(TreeFlashConfig(d_target=target.config.d_model, vocab_size=target.vocab_size,
                                       d_model=cfg.d_model, depth=cfg.depth, n_layer=cfg.n_layer)).to(device)

    def loss_fn(x):
        kl_c, kl_m, *_ = treeflash_losses(target, net, x)
        return kl_c + kl_m

    phase = PhaseConfig(cfg.steps, cfg.lr, cfg.warmup, cfg.weight_decay,
                        max_seconds=None if cfg.minutes is None else 60 * cfg.minutes,
                        eval_every=cfg.eval_every, cuda_graphs=cfg.cuda_graphs, desc="treeflash (KL)")
    backend.use("torch")  # the target's differentiable-path references (no Triton in the loss)
    try:
        res = run_phase(net, loss_fn, sampler, phase, device, evaluate=lambda: eval_treeflash(target, net, windows))
    finally:
        backend.use(None)
    out_dir = save_treeflash(_compact(net), Path(cfg.out) / TREEFLASH_DIR)
    log = {"config": asdict(cfg), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "params": sum(p.numel() for p in net.parameters()),
           "checkpoint_bytes": sum(p.stat().st_size for p in out_dir.iterdir()),
           "train_tokens": int(len(train_tokens)), "steps": res.steps, "seconds": round(res.seconds, 1),
           "step_ms": round(res.step_ms, 2), "note": res.note,
           "loss": [(s, round(v, 4)) for s, v in res.losses],
           "evals": [(s, {k: round(v, 4) for k, v in m.items()}) for s, m in res.evals],
           "total_seconds": round(time.perf_counter() - started, 1)}
    (Path(cfg.out) / TF_LOG_FILE).write_text(json.dumps(log, indent=1, default=str))
    plot_treeflash(log, Path(cfg.out) / TF_PLOT_FILE)
    return log


def _compact(net: TreeFlashNet) -> TreeFlashNet:
    """A CPU copy with matrices in bf16 (vectors stay fp32): a checkpoint of a few MB."""
    clone = TreeFlashNet(net.config)
    clone.load_state_dict(net.state_dict())
    with torch.no_grad():
        for p in clone.parameters():
            if p.dim() >= 2:
                p.data = p.data.to(torch.bfloat16)
    return clone


def plot_treeflash(log: dict, path: Path) -> None:
    """Train loss and validation KL per head (left); validation top-1 agreement per depth (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if log["loss"]:
        steps, losses = zip(*log["loss"])
        ax1.plot(steps, losses, lw=0.8, alpha=0.7, label="train (cond + marginal KL)")
    if log["evals"]:
        es, em = zip(*log["evals"])
        ax1.plot(es, [m["val_kl"] for m in em], "o-", label="val KL, conditional")
        ax1.plot(es, [m["val_kl_marginal"] for m in em], "s--", label="val KL, marginal")
        for k in range(log["config"]["depth"]):
            ax2.plot(es, [m[f"val_top1_depth{k + 1}"] for m in em], "o-", label=f"depth {k + 1}")
        ax2.plot(es, [m["val_top1_agreement_marginal"] for m in em], "k--", label="marginal (all depths)")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_title("TreeFlash: KL(target || draft)", fontsize=10)
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("step")
    ax2.set_title("validation top-1 agreement with the target (conditional head)", fontsize=10)
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"TreeFlash {log['params'] / 1e6:.2f}M params ({log['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
