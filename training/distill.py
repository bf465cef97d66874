"""A drafter for any target: distil a small Mamba2 drafter or a TreeFlash head from a model ``load_model`` reads.

The drafter learns the target's own distribution: KL(target || draft) over the target's whole softmax at every
position of windows of either the offline corpus tokenized with the target's tokenizer (``data="corpus"``) or
sequences the target samples itself at temperature 1 from corpus prefixes (``data="generated"``; random prompt
tokens when the target's folder has no tokenizer). The checkpoint has the target's vocabulary and tokenizer
files, so ``stree generate``/``stree serve`` take it with ``--draft-model``. ``draft_phase`` is also the drafter
half of ``train_pair``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from stree.kernels import backend
from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.generation_settings import load_generation_settings
from stree.verifier.model.lm import StreeLM
from stree.verifier.model.tokenizer import load_tokenizer
from stree.verifier.model.treeflash import DEFAULT_D_MODEL, DEFAULT_DEPTH, TreeFlashConfig, TreeFlashNet, save_treeflash

from stree.training.corpus import DEFAULT_PACKAGES, MAX_FILE_BYTES
from stree.training.data import (RowSampler, WindowSampler, corpus_files, corpus_tokens, default_cache_dir,
                                 eval_windows, rank_zero_first)
from stree.training.distributed import DistEnv, rank_rows
from stree.training.fast_forward import TrainForward, head
from stree.training.flops import forward_flops_per_token, train_flops_per_token
from stree.training.loop import run_phase
from stree.training.model_shape import Shape, make_model
from stree.training.losses import draft_stats, linear_kl
from stree.training.run_settings import RunSettings, autocast, compact_copy, dir_bytes, phase_log, save_compact
from stree.training.ssd import ssd_backend
from stree.training.treeflash import plot_treeflash, treeflash_phase

KINDS = ("mamba", "treeflash")
DATA = ("corpus", "generated")
LOG_FILE, PLOT_FILE = "train_log.json", "train_loss.png"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class DraftSettings:
    """What a distillation phase runs for: steps (or minutes), schedule, global batch of windows."""

    steps: int = 2000
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    minutes: Optional[float] = None
    eval_every: int = 200
    batch_size: int = 32
    seq_len: int = 256
    checkpoint: Optional[str] = None  # resume file


def draft_loss(t_fwd: TrainForward, d_fwd: TrainForward, x: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per position of windows ``x`` ``[B, T+1]`` (the last token is only a label)."""
    inp = x[:, :-1]
    with torch.no_grad():
        t_h = t_fwd(inp)
    w_t, s_t = head(t_fwd.model)
    w_d, s_d = head(d_fwd.model)
    return linear_kl(d_fwd(inp), w_d, t_h, w_t, s_d, s_t)


@torch.no_grad()
def eval_draft(t_fwd: TrainForward, d_fwd: TrainForward, windows: list, env: DistEnv) -> dict:
    """Validation KL, the drafter's own cross-entropy, and how often its argmax is the target's (every rank's
    windows)."""
    sums = {"kl": 0.0, "ce": 0.0, "top1": 0.0, "n": 0.0}
    with autocast(env.device):
        for x in windows:
            inp = x[:, :-1]
            w_t, s_t = head(t_fwd.model)
            w_d, s_d = head(d_fwd.model)
            for k, v in draft_stats(d_fwd(inp), w_d, t_fwd(inp), w_t, x[:, 1:], s_d, s_t).items():
                sums[k] += v
    kl, ce, top1, n = env.all_sum([sums["kl"], sums["ce"], sums["top1"], sums["n"]])
    n = max(n, 1.0)
    return {"val_kl": kl / n, "val_ce": ce / n, "val_top1_agreement": top1 / n}


def draft_phase(target: StreeLM, draft: StreeLM, sampler, windows: list, settings: DraftSettings,
                run: RunSettings, env: DistEnv) -> dict:
    """Distil the Mamba2 ``draft`` from the frozen ``target`` (KL over the target's softmax); the phase's log."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary {draft.vocab_size} != target vocabulary {target.vocab_size}")
    t_fwd = TrainForward(target, compile=run.compile)
    d_fwd = TrainForward(draft, compile=run.compile, recompute=run.recompute)
    flops = train_flops_per_token(draft, settings.seq_len) + forward_flops_per_token(target, settings.seq_len)
    phase = run.phase(env, settings.batch_size, settings.seq_len, steps=settings.steps, lr=settings.lr,
                      warmup=settings.warmup, weight_decay=settings.weight_decay,
                      max_seconds=None if settings.minutes is None else 60 * settings.minutes,
                      eval_every=settings.eval_every, desc="draft (KL)", flops_per_token=flops,
                      checkpoint=settings.checkpoint)
    res = run_phase(draft, lambda x: draft_loss(t_fwd, d_fwd, x), sampler, phase, env,
                    evaluate=lambda: eval_draft(t_fwd, d_fwd, windows, env))
    return phase_log(res, phase.tokens_per_step, flops)


@torch.no_grad()
def sample_sequences(target: StreeLM, prompts: torch.Tensor, length: int, batch: int = 64,
                     temperature: float = 1.0, seed: int = 0) -> np.ndarray:
    """``[N, length]`` rows: each prompt ``[N, P]`` continued by the target's own samples (plain decoding)."""
    n, p = prompts.shape
    if length <= p:
        raise ValueError(f"sequence length {length} must exceed the prompt length {p}")
    dev = target.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = []
    for start in tqdm(range(0, n, batch), desc="target samples", mininterval=2.0):
        ids = prompts[start:start + batch].to(dev)
        state = target.new_state(ids.shape[0], length)
        logits = target.prefill(ids, state)[:, -1]
        out = [ids]
        for _ in range(length - p):
            probs = torch.softmax(logits.float() / temperature, -1)
            tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
            out.append(tok[:, None])
            logits = target.step(tok, state)
        rows.append(torch.cat(out, 1).cpu().numpy())
    return np.concatenate(rows)


@dataclass
class DrafterConfig:
    target: str
    out: str
    kind: str = "mamba"
    layers: Optional[int] = None  # mamba: 2; treeflash: its mixer blocks (2)
    d_model: Optional[int] = None  # mamba: min(512, the target's); treeflash: 128
    d_state: int = 64
    headdim: int = 64
    depth: int = DEFAULT_DEPTH  # treeflash: depths drafted per pass
    data: str = "corpus"
    gen_sequences: int = 2048  # data=generated: sequences the target samples (the last eval ones are held out)
    prompt_len: int = 16
    temperature: float = 1.0
    steps: int = 2000
    minutes: Optional[float] = None
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: Optional[float] = None  # mamba 0.1, treeflash 0.0
    eval_every: int = 200
    eval_batches: int = 2
    packages: tuple = DEFAULT_PACKAGES
    corpus_bytes: int = 24_000_000
    max_file_bytes: int = MAX_FILE_BYTES
    val_fraction: float = 0.02
    corpus_roots: Optional[list] = None
    cache_dir: Optional[str] = None  # default: data.default_cache_dir()
    device: str = "cpu"
    seed: int = 0
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.data not in DATA:
            raise ValueError(f"--data must be one of {', '.join(DATA)}, got {self.data!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_batches", "gen_sequences", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def _data(cfg: DrafterConfig, target: StreeLM, env: DistEnv):
    """``(training sampler, validation windows, data description)`` on the target's tokenization."""
    tokenizer = load_tokenizer(cfg.target)
    cache = cfg.cache_dir or default_cache_dir()
    rows = rank_rows(cfg.batch_size, env)
    tokens = None
    if tokenizer is not None:
        eos = (load_generation_settings(cfg.target).eos_token_ids or [None])[0]
        files, _ = corpus_files(cfg.packages, cfg.corpus_roots, cfg.seed, cfg.val_fraction, cfg.max_file_bytes)
        tokens = corpus_tokens(files, tokenizer, eos, cfg.corpus_bytes, cache, env, cfg.run.workers)
        top = max(int(tokens.train.max()), int(tokens.val.max()))
        if top >= target.vocab_size:
            raise ValueError(f"{cfg.target}: its tokenizer gives id {top}, outside the model's vocabulary "
                             f"({target.vocab_size})")
    elif cfg.data == "corpus":
        raise ValueError(f"{cfg.target} has no tokenizer.json: use --data generated (the target's own samples)")
    if cfg.data == "corpus":
        sampler = WindowSampler(tokens.train, cfg.batch_size, cfg.seq_len, cfg.seed + 3, env.device, rows)
        windows = eval_windows(tokens.val, cfg.eval_batches, cfg.batch_size, cfg.seq_len, env.device, env,
                               cfg.run.eval_rows(env, cfg.batch_size))
        return sampler, windows, {"data": "corpus", **{k: tokens.meta[k] for k in ("train_tokens", "val_tokens",
                                                                                      "bytes", "duplicates")}}
    held = cfg.eval_batches * cfg.batch_size
    g = torch.Generator().manual_seed(cfg.seed + 5)
    n = cfg.gen_sequences + held
    if tokens is not None:
        starts = torch.randint(0, len(tokens.train) - cfg.prompt_len, (n,), generator=g).numpy()
        prompts = torch.from_numpy(np.stack([tokens.train[s:s + cfg.prompt_len] for s in starts]).astype(np.int64))
    else:
        prompts = torch.randint(0, target.vocab_size, (n, cfg.prompt_len), generator=g)
    path = Path(cache) / f"generated-{_target_key(cfg.target)}-{cfg.seed}-{n}x{cfg.seq_len + 1}-t{cfg.temperature}.npy"

    def make():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with torch.autocast(env.device.type, enabled=False):
                seqs = sample_sequences(target, prompts, cfg.seq_len + 1, temperature=cfg.temperature, seed=cfg.seed)
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, seqs)
            tmp.replace(path)
        return np.load(path)

    seqs = rank_zero_first(env, make)
    train, val = seqs[:-held], seqs[-held:]
    sampler = RowSampler(train, cfg.batch_size, cfg.seed + 3, env.device, rows)
    step = cfg.run.eval_rows(env, cfg.batch_size)
    batches = [torch.from_numpy(val[i:i + step].astype(np.int64)) for i in range(0, held, step)]
    batches = batches[env.rank::env.world_size]
    return sampler, [b.to(env.device) for b in batches], {"data": "generated", "sequences": int(len(train)),
                                                           "temperature": cfg.temperature}


def _target_key(target: str) -> str:
    """Names the target's samples in the cache: its folder and its files' sizes and times."""
    folder = Path(target).resolve()
    stats = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())
    return hashlib.sha256(repr((str(folder), stats)).encode()).hexdigest()[:12]


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def train_drafter(cfg: DrafterConfig, env: DistEnv | None = None) -> dict:
    """Distil a ``cfg.kind`` drafter from ``cfg.target`` into ``cfg.out`` (checkpoint, log, loss plot); the log."""
    started = time.perf_counter()
    env = env or DistEnv(device=torch.device(cfg.device))
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    # a CPU target computes in float32; on CUDA it keeps its checkpoint's dtype (autocast does the rest)
    target = load_model(cfg.target, device=env.device, dtype=None if env.device.type == "cuda" else torch.float32)
    target.eval().requires_grad_(False)
    sampler, windows, data = _data(cfg, target, env)
    settings = DraftSettings(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, minutes=cfg.minutes,
                             eval_every=cfg.eval_every, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                             checkpoint=str(out / "resume.pt"))
    backend.use("torch")  # blocks outside the fast path run the differentiable PyTorch references
    try:
        if cfg.kind == "mamba":
            d_model = cfg.d_model or min(512, target.config.d_model)
            shape = Shape(d_model, cfg.layers or 2, (), cfg.d_state, min(cfg.headdim, 2 * d_model))
            draft = make_model(shape, target.vocab_size, cfg.seed + 2, env.device)
            settings.weight_decay = 0.1 if cfg.weight_decay is None else cfg.weight_decay
            phase = draft_phase(target, draft, sampler, windows, settings, cfg.run, env)
            params = sum(p.numel() for p in draft.parameters())
        else:
            net = TreeFlashNet(TreeFlashConfig(d_target=target.config.d_model, vocab_size=target.vocab_size,
                                               d_model=cfg.d_model or DEFAULT_D_MODEL, depth=cfg.depth,
                                               n_layer=cfg.layers or 2)).to(env.device)
            settings.weight_decay = 0.0 if cfg.weight_decay is None else cfg.weight_decay
            phase = treeflash_phase(target, net, sampler, windows, settings, cfg.run, env)
            params = phase.pop("params")
    finally:
        backend.use(None)
    log = {"config": asdict(cfg), "kind": cfg.kind, "target": str(cfg.target), "data": data,
           "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
           "gpus": env.world_size if env.device.type == "cuda" else 0, "processes": env.world_size,
           "ssd": ssd_backend(env.device), "params": params,
           "target_params": sum(p.numel() for p in target.parameters()), **phase}
    if env.is_main:
        if cfg.kind == "mamba":
            save_compact(draft, out)
        else:
            save_treeflash(compact_copy(net), out)
        _copy_tokenizer(Path(cfg.target), out)
        log["checkpoint_bytes"] = dir_bytes(out)
        log["seconds"] = round(time.perf_counter() - started, 1)
        (out / LOG_FILE).write_text(json.dumps(log, indent=1, default=str))
        plot = plot_treeflash if cfg.kind == "treeflash" else plot_draft
        plot({**log, "config": {**log["config"], "depth": cfg.depth}}, out / PLOT_FILE)
    env.barrier()
    return log


def plot_draft(log: dict, path: Path) -> None:
    """Train KL and validation KL (left axis), validation top-1 agreement with the target (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if log["loss"]:
        steps, losses = zip(*log["loss"])
        ax.plot(steps, losses, lw=0.8, alpha=0.7, label="train KL")
    if log["evals"]:
        es, em = zip(*log["evals"])
        ax.plot(es, [m["val_kl"] for m in em], "o-", label="validation KL")
        twin = ax.twinx()
        twin.plot(es, [m["val_top1_agreement"] for m in em], "s--", color="tab:green")
        twin.set_ylim(0, 1)
        twin.set_ylabel("validation top-1 agreement with the target")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.legend(loc="upper right")
    ax.set_title(f"Mamba2 drafter {log['params'] / 1e6:.2f}M params, KL(target || draft) ({log['device']})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
