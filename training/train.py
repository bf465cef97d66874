"""Train the demo pair: a small hybrid Mamba2+attention target LM, then a Mamba2 drafter distilled from it.

The drafter learns KL(target || draft) on the target's softmax over the training text (as the
STree authors trained theirs). Both share one byte-level BPE tokenizer trained on the corpus.
Checkpoints are written in mamba_ssm's format with matrices in bf16 (small enough for git), plus a
JSON training log and a loss-curve PNG next to them.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from stree.kernels import backend
from stree.verifier.model.checkpoint import random_init_, save_model
from stree.verifier.model.config import ModelConfig
from stree.verifier.model.lm import StreeLM
from stree.verifier.model.tokenizer import bpe_tokenizer, eos_token_id

from stree.training.corpus import DEFAULT_PACKAGES, Corpus, build_corpus, tokenize
from stree.training.loop import PhaseConfig, run_phase

TARGET_DIR, DRAFT_DIR = "demo-target", "demo-draft"
LOG_FILE, PLOT_FILE = "train_log.json", "train_loss.png"


@dataclass
class Shape:
    """Model size: Mamba2 layers, with attention at ``attn_layers`` (a hybrid) when non-empty."""

    d_model: int
    n_layer: int
    attn_layers: tuple = ()
    d_state: int = 64
    headdim: int = 64
    attn_head_dim: int = 64

    def config(self, vocab_size: int) -> ModelConfig:
        attn = {}
        if self.attn_layers:
            heads = max(1, self.d_model // self.attn_head_dim)
            attn = {"num_heads": heads, "num_heads_kv": heads, "head_dim": self.d_model // heads,
                    "rotary_emb_dim": self.d_model // heads}
        return ModelConfig(
            d_model=self.d_model, n_layer=self.n_layer, vocab_size=vocab_size,
            ssm_cfg={"layer": "Mamba2", "d_state": self.d_state, "headdim": self.headdim, "expand": 2},
            attn_layer_idx=list(self.attn_layers), attn_cfg=attn,
        )


@dataclass
class TrainConfig:
    out: str = "checkpoints"
    vocab_size: int = 8192
    # Deep and narrow: a decode step costs per layer (launch-bound at this size), so 20 layers give
    # the target a cost ratio to the 2-layer drafter closer to real target/draft pairs.
    target: Shape = field(default_factory=lambda: Shape(256, 20, (10,)))
    draft: Shape = field(default_factory=lambda: Shape(256, 2))
    target_steps: int = 2000
    draft_steps: int = 1500
    batch_size: int = 32
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
    tokenizer_bytes: int = 8_000_000
    val_fraction: float = 0.02
    corpus_roots: Optional[list] = None
    device: str = "cpu"
    seed: int = 0
    cuda_graphs: bool = True


def make_model(shape: Shape, vocab_size: int, seed: int, device) -> StreeLM:
    return random_init_(StreeLM(shape.config(vocab_size)), seed).to(device)


def lm_loss(model: StreeLM, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on windows ``x`` ``[B, T+1]``."""
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def distill_loss(target: StreeLM, draft: StreeLM, x: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per token, over the target's full softmax."""
    inp = x[:, :-1]
    with torch.no_grad():
        t_logp = F.log_softmax(target(inp).float(), -1)
    d_logp = F.log_softmax(draft(inp).float(), -1)
    v = d_logp.shape[-1]
    return F.kl_div(d_logp.reshape(-1, v), t_logp.reshape(-1, v), log_target=True, reduction="batchmean")


class WindowSampler:
    """Random training windows of ``seq_len + 1`` tokens, reproducible from the seed and step."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.batch_size, self.seq_len, self.seed, self.device = batch_size, seq_len, seed, device
        self.offsets = torch.arange(seq_len + 1)

    def __call__(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)
        return self.tokens[starts[:, None] + self.offsets].to(self.device, non_blocking=True)


def eval_windows(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int, device) -> list:
    """Fixed, evenly spaced validation windows (the same for every evaluation)."""
    count = n_batches * batch_size
    span = len(tokens) - seq_len - 1
    if span < 1:
        raise ValueError(f"validation split has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    starts = np.linspace(0, span - 1, count).astype(np.int64)
    windows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return [torch.from_numpy(windows[i * batch_size:(i + 1) * batch_size]).to(device) for i in range(n_batches)]


def _autocast(device):
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def eval_target(target: StreeLM, windows: list, device) -> dict:
    with _autocast(device):
        loss = sum(float(lm_loss(target, x)) for x in windows) / len(windows)
    return {"val_ce": loss, "val_ppl": float(np.exp(min(loss, 50.0)))}


@torch.no_grad()
def eval_draft(target: StreeLM, draft: StreeLM, windows: list, device) -> dict:
    """Validation KL, the drafter's own cross-entropy, and how often its argmax is the target's."""
    kl = ce = agree = 0.0
    with _autocast(device):
        for x in windows:
            inp = x[:, :-1]
            t = target(inp).float()
            d = draft(inp).float()
            v = d.shape[-1]
            kl += float(F.kl_div(F.log_softmax(d, -1).reshape(-1, v), F.log_softmax(t, -1).reshape(-1, v),
                                 log_target=True, reduction="batchmean"))
            ce += float(F.cross_entropy(d.reshape(-1, v), x[:, 1:].reshape(-1)))
            agree += float((d.argmax(-1) == t.argmax(-1)).float().mean())
    n = len(windows)
    return {"val_kl": kl / n, "val_ce": ce / n, "val_top1_agreement": agree / n}


def save_compact(model: StreeLM, out_dir: Path, tokenizer) -> Path:
    """Save with matrices in bf16 and vectors (A_log, dt_bias, D, norms, biases) in fp32."""
    clone = copy.deepcopy(model).cpu()
    with torch.no_grad():
        for p in clone.parameters():
            if p.dim() >= 2:
                p.data = p.data.to(torch.bfloat16)
    return save_model(clone, out_dir, tokenizer)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def train_pair(cfg: TrainConfig, corpus: Optional[Corpus] = None) -> dict:
    """Build the corpus and tokenizer, train the target, distill the drafter, save both; returns the log."""
    started = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    if corpus is None:
        corpus = build_corpus(cfg.packages, cfg.corpus_bytes, cfg.val_fraction,
                              roots=cfg.corpus_roots, seed=cfg.seed)
    print(f"corpus: {corpus.meta['train_files']} train / {corpus.meta['val_files']} val files, "
          f"{corpus.meta['bytes'] / 1e6:.1f} MB", flush=True)
    t0 = time.perf_counter()
    tok_texts, size = [], 0
    for doc in corpus.train:  # the BPE is trained on a prefix of the (shuffled) train split
        if size >= cfg.tokenizer_bytes:
            break
        tok_texts.append(doc)
        size += len(doc)
    tokenizer = bpe_tokenizer(cfg.vocab_size, tok_texts)
    vocab = tokenizer.get_vocab_size()
    eos = eos_token_id(tokenizer)
    train_tokens = tokenize(tokenizer, corpus.train, eos)
    val_tokens = tokenize(tokenizer, corpus.val, eos)
    tok_s = time.perf_counter() - t0
    print(f"tokenizer: vocab {vocab}; {len(train_tokens)} train / {len(val_tokens)} val tokens "
          f"({tok_s:.1f}s)", flush=True)
    sampler = WindowSampler(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed, device)
    windows = eval_windows(val_tokens, cfg.eval_batches, cfg.batch_size, cfg.seq_len, device)

    backend.use("torch")  # training runs the differentiable PyTorch references
    try:
        target = make_model(cfg.target, vocab, cfg.seed + 1, device)
        t_cfg = PhaseConfig(cfg.target_steps, cfg.target_lr, cfg.warmup, cfg.weight_decay,
                            max_seconds=None if cfg.target_minutes is None else 60 * cfg.target_minutes,
                            eval_every=cfg.eval_every, cuda_graphs=cfg.cuda_graphs, desc="target")
        t_res = run_phase(target, lambda x: lm_loss(target, x), sampler, t_cfg, device,
                          evaluate=lambda: eval_target(target, windows, device))
        target.requires_grad_(False)
        draft = make_model(cfg.draft, vocab, cfg.seed + 2, device)
        d_cfg = PhaseConfig(cfg.draft_steps, cfg.draft_lr, cfg.warmup, cfg.weight_decay,
                            max_seconds=None if cfg.draft_minutes is None else 60 * cfg.draft_minutes,
                            eval_every=cfg.eval_every, cuda_graphs=cfg.cuda_graphs, desc="draft (KL)")
        d_res = run_phase(draft, lambda x: distill_loss(target, draft, x), lambda s: sampler(s + 10**7),
                          d_cfg, device, evaluate=lambda: eval_draft(target, draft, windows, device))
    finally:
        backend.use(None)
    target_dir = save_compact(target, out / TARGET_DIR, tokenizer)
    draft_dir = save_compact(draft, out / DRAFT_DIR, tokenizer)
    log = {
        "config": {k: (asdict(v) if isinstance(v, Shape) else v) for k, v in vars(cfg).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "corpus": corpus.meta,
        "tokenizer": {"vocab_size": vocab, "train_tokens": int(len(train_tokens)),
                      "val_tokens": int(len(val_tokens)), "seconds": round(tok_s, 2)},
        "params": {"target": sum(p.numel() for p in target.parameters()),
                   "draft": sum(p.numel() for p in draft.parameters())},
        "checkpoint_bytes": {"target": dir_bytes(target_dir), "draft": dir_bytes(draft_dir)},
        "target": _phase_log(t_res, cfg.batch_size * cfg.seq_len),
        "draft": _phase_log(d_res, cfg.batch_size * cfg.seq_len),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / LOG_FILE).write_text(json.dumps(log, indent=1, default=str))
    try:
        plot_losses(log, out / PLOT_FILE)
    except ImportError as exc:  # the checkpoints and log are saved; the plot can be redrawn from the log
        print(f"no loss plot ({exc}); redraw it with `stree train --replot {out}`", flush=True)
    return log


def _phase_log(res, tokens_per_step: int) -> dict:
    return {"steps": res.steps, "seconds": round(res.seconds, 1), "step_ms": round(res.step_ms, 2),
            "tokens_seen": res.steps * tokens_per_step, "cuda_graph": res.graphed, "note": res.note,
            "loss": [(s, round(v, 4)) for s, v in res.losses],
            "evals": [(s, {k: round(v, 4) for k, v in m.items()}) for s, m in res.evals]}


def plot_losses(log: dict, path: Path) -> None:
    """Two panels: target cross-entropy (train, validation) and drafter KL / top-1 agreement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase, key, label in ((ax1, "target", "val_ce", "target: next-token CE"),
                                  (ax2, "draft", "val_kl", "drafter: KL(target || draft)")):
        steps, losses = zip(*log[phase]["loss"]) if log[phase]["loss"] else ((), ())
        ax.plot(steps, losses, lw=0.8, alpha=0.7, label="train")
        if log[phase]["evals"]:
            es, em = zip(*log[phase]["evals"])
            ax.plot(es, [m[key] for m in em], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=10)
        ax.set_yscale("log")
        ax.legend(loc="upper right")
    if log["draft"]["evals"]:
        es, em = zip(*log["draft"]["evals"])
        twin = ax2.twinx()
        twin.plot(es, [m["val_top1_agreement"] for m in em], "s--", color="tab:green", label="top-1 agreement")
        twin.set_ylim(0, 1)
        twin.set_ylabel("validation top-1 agreement with target")
    fig.suptitle(f"demo pair: target {log['params']['target'] / 1e6:.1f}M, "
                 f"draft {log['params']['draft'] / 1e6:.1f}M params ({log['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
