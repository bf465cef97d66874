"""Distil a TreeFlash drafter from a trained target: KL to the target's next-token law at every depth.

For each position t the drafter sees the target's final-norm hidden state h_t and the root
x_{t+1}; depth k's marginal and conditional heads (the latter also given the parent x_{t+1+k})
are both fitted to the target's distribution after x_{t+1+k}. The marginal head is the ablation's
drafter and the conditional head's starting point, so both are trained together.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from stree.verifier.model.lm import StreeLM
from stree.verifier.model.treeflash import TreeFlashNet

from stree.training.distributed import DistEnv
from stree.training.fast_forward import TrainForward, head
from stree.training.flops import forward_flops_per_token
from stree.training.loop import run_phase
from stree.training.run_settings import RunSettings, autocast, phase_log


def depth_views(target: StreeLM, x: torch.Tensor, depth: int, fwd: TrainForward | None = None):
    """The target's hidden states, roots, per-depth parents and per-depth log-probs for windows ``x``.

    Returns ``hidden [P, d]``, ``roots [P]``, ``parents [P, K]``, ``target_logp [P, K, V]`` over every
    window position with K tokens after its root. ``fwd``: the target's training forward (made if not given).
    """
    inp = x[:, :-1]
    with torch.no_grad():
        hidden = (fwd or TrainForward(target))(inp)
        w, scale = head(target)
        logp = F.log_softmax(F.linear(hidden, w).float() * scale, -1)
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


def treeflash_losses(target: StreeLM, net: TreeFlashNet, x: torch.Tensor, fwd: TrainForward | None = None):
    """``(conditional KL, marginal KL, conditional logits, marginal logits, target log-probs)`` on windows ``x``."""
    hidden, roots, parents, t_logp = depth_views(target, x, net.config.depth, fwd)
    states = net.depth_states(hidden, roots)
    cond = net.conditional_logits(states, parents)
    marg = net.marginal_logits(states)
    return _kl(t_logp, cond), _kl(t_logp, marg), cond, marg, t_logp


@torch.no_grad()
def eval_treeflash(target: StreeLM, net: TreeFlashNet, windows: list, fwd: TrainForward | None = None,
                   env: DistEnv | None = None) -> dict:
    """Validation KL and top-1 agreement with the target per head, and the conditional head's per depth (the
    mean over every rank's windows)."""
    sums: dict = {}
    with autocast(windows[0].device if windows else "cpu"):
        for x in windows:
            kl_c, kl_m, cond, marg, t_logp = treeflash_losses(target, net, x, fwd)
            best = t_logp.argmax(-1)
            per_depth = (cond.argmax(-1) == best).float().mean(0)
            vals = {"val_kl": float(kl_c), "val_kl_marginal": float(kl_m),
                    "val_top1_agreement": float(per_depth.mean()),
                    "val_top1_agreement_marginal": float((marg.argmax(-1) == best).float().mean())}
            vals.update({f"val_top1_depth{k + 1}": float(a) for k, a in enumerate(per_depth)})
            for k, v in vals.items():
                sums[k] = sums.get(k, 0.0) + v
    keys = [f"val_{k}" for k in ("kl", "kl_marginal", "top1_agreement", "top1_agreement_marginal")]
    keys += [f"val_top1_depth{k + 1}" for k in range(net.config.depth)]
    totals = [sums.get(k, 0.0) for k in keys] + [float(len(windows))]
    if env is not None:
        totals = env.all_sum(totals)
    return {k: v / max(totals[-1], 1.0) for k, v in zip(keys, totals)}


def treeflash_phase(target: StreeLM, net: TreeFlashNet, sampler, windows: list, settings, run: RunSettings,
                    env: DistEnv) -> dict:
    """Distil ``net`` from the frozen ``target`` (conditional + marginal KL at every depth); the phase's log.
    ``settings``: a ``distill.DraftSettings``."""
    fwd = TrainForward(target, compile=run.compile)
    flops = 3.0 * sum(2.0 * p.numel() for p in net.parameters() if p.dim() >= 2)
    flops += forward_flops_per_token(target, settings.seq_len)

    def loss_fn(x):
        kl_c, kl_m, *_ = treeflash_losses(target, net, x, fwd)
        return kl_c + kl_m

    phase = run.phase(env, settings.batch_size, settings.seq_len, steps=settings.steps, lr=settings.lr,
                      warmup=settings.warmup, weight_decay=settings.weight_decay,
                      max_seconds=None if settings.minutes is None else 60 * settings.minutes,
                      eval_every=settings.eval_every, desc="treeflash (KL)", flops_per_token=flops,
                      checkpoint=settings.checkpoint)
    res = run_phase(net, loss_fn, sampler, phase, env, evaluate=lambda: eval_treeflash(target, net, windows, fwd, env))
    return {**phase_log(res, phase.tokens_per_step, flops), "params": sum(p.numel() for p in net.parameters()),
            "net": asdict(net.config)}


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
