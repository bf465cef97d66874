"""``stree bench scale-pair``: train the benchmark pair at scale and record how the training went.

Two ``stree`` commands, each its own process (re-run under torchrun with ``--gpus`` processes): the target (a
48-layer, d_model-1024 hybrid of about 315M parameters, attention at layers 16 and 32) with its 2-layer
d_model-512 Mamba2 drafter (``stree train``), then a TreeFlash head on the target (``stree train drafter --kind
treeflash``), on every installed package's sources (``--packages all``), seeded. Writes the checkpoints under
``OUT/pair/`` and the record ``scale-pair-train-<card>-<date>.json`` (to ``--results`` and to ``OUT``) with the
training throughput, MFU, validation perplexity, the drafters' KL and top-1 agreement and the wall times; progress
goes to stdout as it happens. ``--tiny`` runs the same pipeline at toy size (CPU tests, a quick GPU check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from stree.training.distributed import SAFE_ENV

TARGET, DRAFT, TREEFLASH = "scale-target", "scale-draft", "scale-treeflash"


@dataclass
class Sizes:
    """The pair's shapes and the phases' budgets (per-process micro-batch, global batch per GPU)."""

    target_d_model: int = 1024
    target_layers: int = 48
    attn_layers: str = "16,32"
    draft_d_model: int = 512
    draft_layers: int = 2
    treeflash_d_model: int = 256
    d_state: int = 64
    headdim: int = 64
    vocab: int = 8192
    seq_len: int = 1024
    batch_per_gpu: int = 32
    micro_batch: int = 8
    target_minutes: float = 5.5
    draft_minutes: float = 1.5
    treeflash_minutes: float = 1.0
    treeflash_seq_len: int = 256
    target_steps: int = 100_000  # the minutes decide
    draft_steps: int = 100_000
    treeflash_steps: int = 100_000
    eval_every: int = 200
    corpus_bytes: int = 400_000_000
    max_file_bytes: int = 1_000_000
    lr: float = 2e-3
    draft_lr: float = 3e-3


TINY = Sizes(target_d_model=64, target_layers=4, attn_layers="1,2", draft_d_model=32, draft_layers=1,
             treeflash_d_model=32, d_state=16, headdim=16, vocab=300, seq_len=64, batch_per_gpu=4, micro_batch=2,
             target_minutes=None, draft_minutes=None, treeflash_minutes=None, treeflash_seq_len=32, target_steps=12,
             draft_steps=8, treeflash_steps=6, eval_every=6, corpus_bytes=2_000_000, max_file_bytes=200_000)


def card_name(device: torch.device) -> str:
    """``h100``, ``h200``, ... from the GPU's name (``cpu`` without one)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "b200", "a100", "l40s") if k in name), name.split()[-1])


def _common(args, s: Sizes) -> list[str]:
    out = ["--gpus", str(args.gpus), "--seed", str(args.seed), "--packages", args.packages,
           "--corpus-bytes", str(s.corpus_bytes), "--max-file-bytes", str(s.max_file_bytes),
           "--cache-dir", str(Path(args.out) / "cache"), "--micro-batch", str(s.micro_batch),
           "--eval-every", str(s.eval_every)]
    for root in args.corpus_root or []:
        out += ["--corpus-root", root]
    if args.device:
        out += ["--device", args.device]
    if args.compile:
        out.append("--compile")
    if args.workers:
        out += ["--workers", str(args.workers)]
    return out


def _minutes(flag: str, value) -> list[str]:
    return [] if value is None else [flag, str(value)]


def phase_commands(args, s: Sizes) -> dict[str, list[str]]:
    """The ``stree`` argv of each phase."""
    pair = Path(args.out) / "pair"
    batch = str(s.batch_per_gpu * args.gpus)
    common = _common(args, s)
    return {
        "target+draft": ["train", "--out", str(pair), "--prefix", "scale", "--vocab-size", str(s.vocab),
                         "--target-d-model", str(s.target_d_model), "--target-layers", str(s.target_layers),
                         "--target-attn-layers", s.attn_layers, "--draft-d-model", str(s.draft_d_model),
                         "--draft-layers", str(s.draft_layers), "--d-state", str(s.d_state), "--headdim",
                         str(s.headdim), "--steps", str(s.target_steps), "--draft-steps", str(s.draft_steps),
                         *_minutes("--target-minutes", s.target_minutes), *_minutes("--draft-minutes", s.draft_minutes),
                         "--batch-size", batch, "--seq-len", str(s.seq_len), "--lr", str(s.lr),
                         "--draft-lr", str(s.draft_lr), "--rescale-residual", *common],
        "treeflash": ["train", "drafter", "--target", str(pair / TARGET), "--kind", "treeflash", "--out",
                      str(pair / TREEFLASH), "--d-model", str(s.treeflash_d_model), "--steps", str(s.treeflash_steps),
                      *_minutes("--minutes", s.treeflash_minutes), "--batch-size", batch, "--seq-len",
                      str(s.treeflash_seq_len), *common],
    }


def run_stree(argv: list[str]) -> int:
    """One phase as its own process (it re-runs itself under torchrun for several GPUs), so that each phase starts
    with the GPUs' memory free."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in SAFE_ENV.items()}}
    return subprocess.call([sys.executable, "-m", "stree.cli", *argv], env=env)


def _last_eval(phase: dict) -> dict:
    return phase["evals"][-1][1] if phase and phase.get("evals") else {}


def summarise(out: Path, walls: dict, gpus: int, device: torch.device, tag: str) -> dict:
    """The record: the keys the training issue names, then each phase's details."""
    pair = json.loads((out / "pair" / "train_log.json").read_text())
    tf = json.loads((out / "pair" / TREEFLASH / "train_log.json").read_text())
    t, d = pair["target"], pair["draft"]
    return {
        "benchmark": "scale-pair-train", "date": date.today().isoformat(), "tag": tag,
        "device": pair["device"], "command": "stree " + " ".join(sys.argv[1:]),
        "target_params": pair["params"]["target"], "target_layers": pair["target_layers"], "gpus": gpus,
        "tokens_per_s": t["tokens_per_s"], "mfu": t["mfu"],
        "train_wall_s": round(sum(walls.values()), 1),
        "val_ppl": _last_eval(t).get("val_ppl"),
        "draft_kl": _last_eval(d).get("val_kl"), "draft_top1": _last_eval(d).get("val_top1_agreement"),
        "treeflash_kl": _last_eval(tf).get("val_kl"), "treeflash_top1": _last_eval(tf).get("val_top1_agreement"),
        "draft_params": pair["params"]["draft"], "treeflash_params": tf["params"],
        "phase_wall_s": {k: round(v, 1) for k, v in walls.items()},
        "target": {k: v for k, v in t.items() if k not in ("loss",)},
        "draft": {k: v for k, v in d.items() if k not in ("loss",)},
        "treeflash": {k: tf[k] for k in ("steps", "seconds", "tokens_per_s", "mfu", "evals", "note")},
        "corpus": pair["corpus"], "tokenizer": pair["tokenizer"], "config": pair["config"],
        "checkpoints": {"target": str(out / "pair" / TARGET), "draft": str(out / "pair" / DRAFT),
                        "treeflash": str(out / "pair" / TREEFLASH)},
    }


def minute_caps(text: str) -> tuple[float, float, float]:
    """``--minutes T,D,F``: three positive numbers of minutes (target, drafter, TreeFlash head)."""
    try:
        caps = tuple(float(x) for x in text.split(","))
    except ValueError:
        caps = ()
    if len(caps) != 3 or not all(0 < c < 1e4 for c in caps):
        raise argparse.ArgumentTypeError(f"expected three positive minutes TARGET,DRAFT,TREEFLASH (e.g. 4,1.2,0.8), "
                                         f"got {text!r}")
    return caps


def scale_pair_command(args) -> int:
    sizes = TINY if args.tiny else Sizes()
    if args.minutes:  # wall-clock caps instead of the defaults
        t, d, f = args.minutes
        sizes = dataclasses.replace(sizes, target_minutes=t, draft_minutes=d, treeflash_minutes=f)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and args.gpus > torch.cuda.device_count():
        raise ValueError(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    tag = args.tag or f"{card_name(device)}-{date.today().strftime('%Y%m%d')}"
    walls = {}
    for name, argv in phase_commands(args, sizes).items():
        print(f"[scale-pair] {time.strftime('%H:%M:%S')} phase {name}: stree {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        rc = run_stree(argv)
        walls[name] = time.perf_counter() - t0
        print(f"[scale-pair] {time.strftime('%H:%M:%S')} phase {name} ended (exit {rc}) after {walls[name]:.0f}s",
              flush=True)
        if rc != 0:
            return rc
    record = summarise(out, walls, args.gpus, device, tag)
    name = f"scale-pair-train-{tag}.json"
    for folder in {Path(args.results), out}:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(record, indent=2))
    keys = ("target_params", "target_layers", "gpus", "tokens_per_s", "mfu", "train_wall_s", "val_ppl", "draft_kl",
            "draft_top1", "treeflash_kl", "treeflash_top1")
    print("[scale-pair] " + ", ".join(f"{k} {record[k]}" for k in keys), flush=True)
    print(f"[scale-pair] record: {Path(args.results) / name}; pair: --target {record['checkpoints']['target']} "
          f"--draft {record['checkpoints']['draft']} --treeflash {record['checkpoints']['treeflash']}", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("scale-pair", help="train the ~315M-parameter benchmark pair (target, Mamba2 drafter, "
                                          "TreeFlash) and record throughput, MFU and quality")
    p.add_argument("--out", required=True, help="checkpoints go to OUT/pair, caches to OUT/cache")
    p.add_argument("--gpus", type=int, default=max(1, torch.cuda.device_count()),
                   help="data-parallel processes (default: every GPU)")
    p.add_argument("--tiny", action="store_true", help="toy sizes and a few steps (the pipeline on a CPU)")
    p.add_argument("--packages", default="all", help="corpus packages (default: all installed, and the stdlib)")
    p.add_argument("--corpus-root", action="append", default=None, metavar="DIR",
                   help="read the corpus from DIR instead of site-packages (repeatable)")
    p.add_argument("--results", default="results", help="folder for the record (also written to OUT)")
    p.add_argument("--tag", default=None, help="record name tag (default: <card>-<YYYYMMDD>)")
    p.add_argument("--minutes", type=minute_caps, default=None, metavar="T,D,F",
                   help="training caps in minutes for the target, the drafter and the TreeFlash head "
                        "(default: 5.5,1.5,1)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training pieces")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=scale_pair_command)
