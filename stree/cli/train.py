"""``stree train`` (train the demo target and distill its drafter) and ``stree corpus`` (dump the corpus as JSONL)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from stree.cli.init_model import parse_layer_list

from stree.training.corpus import DEFAULT_PACKAGES, build_corpus
from stree.training.train import LOG_FILE, PLOT_FILE, Shape, TrainConfig, plot_losses, train_pair
from stree.training.treeflash import TREEFLASH_DIR, TreeFlashTrainConfig, train_treeflash
from stree.verifier.model.hub import model_folder_arg
from stree.verifier.model.treeflash import DEFAULT_D_MODEL, DEFAULT_DEPTH, DEFAULT_N_LAYER


def treeflash_command(args, device: str) -> int:
    """``stree train --drafter treeflash``: distil a TreeFlash drafter from an already trained target."""
    cfg = TreeFlashTrainConfig(
        target=args.target or str(Path(args.out) / "demo-target"), out=args.out, d_model=args.treeflash_d_model,
        depth=args.treeflash_depth, n_layer=args.treeflash_layers, steps=args.draft_steps or args.steps,
        minutes=args.draft_minutes, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.draft_lr,
        warmup=args.warmup, eval_every=args.eval_every, packages=tuple(args.packages.split(",")),
        corpus_bytes=args.corpus_bytes, device=device, seed=args.seed, cuda_graphs=not args.no_cuda_graphs)
    log = train_treeflash(cfg)
    last = log["evals"][-1][1] if log["evals"] else {}
    print(f"treeflash: {log['steps']} steps in {log['seconds']}s; val KL conditional "
          f"{last.get('val_kl', '-')}, marginal {last.get('val_kl_marginal', '-')}")
    print(f"checkpoint: {cfg.out}/{TREEFLASH_DIR} ({log['checkpoint_bytes'] / 1e6:.1f} MB)")
    return 0


def train_command(args) -> int:
    if args.replot:
        log_path = Path(args.replot) / LOG_FILE
        plot_losses(json.loads(log_path.read_text()), Path(args.replot) / PLOT_FILE)
        print(f"wrote {Path(args.replot) / PLOT_FILE}")
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.drafter == "treeflash":
        return treeflash_command(args, device)
    cfg = TrainConfig(
        out=args.out, vocab_size=args.vocab_size,
        target=Shape(args.target_d_model, args.target_layers, tuple(parse_layer_list(args.target_attn_layers, "--target-attn-layers")),
                     args.d_state, args.headdim),
        draft=Shape(args.draft_d_model, args.draft_layers, (), args.d_state, args.headdim),
        target_steps=args.steps, draft_steps=args.draft_steps or args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, target_lr=args.lr, draft_lr=args.draft_lr,
        warmup=args.warmup, target_minutes=args.target_minutes, draft_minutes=args.draft_minutes,
        eval_every=args.eval_every, packages=tuple(args.packages.split(",")), corpus_bytes=args.corpus_bytes,
        tokenizer_bytes=args.tokenizer_bytes, device=device, seed=args.seed, cuda_graphs=not args.no_cuda_graphs,
    )
    log = train_pair(cfg)
    t, d = log["target"], log["draft"]
    print(f"target: {t['steps']} steps in {t['seconds']}s, final val {t['evals'][-1][1] if t['evals'] else '-'}")
    print(f"draft:  {d['steps']} steps in {d['seconds']}s, final val {d['evals'][-1][1] if d['evals'] else '-'}")
    print(f"checkpoints: {cfg.out}/demo-target ({log['checkpoint_bytes']['target'] / 1e6:.1f} MB), "
          f"{cfg.out}/demo-draft ({log['checkpoint_bytes']['draft'] / 1e6:.1f} MB)")
    return 0


def corpus_command(args) -> int:
    corpus = build_corpus(tuple(args.packages.split(",")), args.corpus_bytes, seed=args.seed)
    path = corpus.write_jsonl(args.out, args.split)
    print(f"{path}: {len(getattr(corpus, args.split))} documents ({args.split} split) of "
          f"{corpus.meta['files']} files, {corpus.meta['bytes'] / 1e6:.1f} MB in all")
    return 0


def _corpus_options(p) -> None:
    p.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                   help="installed packages whose .py/.pyi/.md/.rst/.txt files form the corpus")
    p.add_argument("--corpus-bytes", type=int, default=24_000_000, help="corpus size cap (bytes)")
    p.add_argument("--seed", type=int, default=0)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train the demo hybrid target and distill a Mamba2 drafter from it")
    p.add_argument("--out", default="checkpoints", help="writes OUT/demo-target, OUT/demo-draft, log and plot")
    p.add_argument("--steps", type=int, default=2000, help="target training steps")
    p.add_argument("--draft-steps", type=int, default=None, help="drafter distillation steps (default: --steps)")
    p.add_argument("--target-minutes", type=float, default=None, help="wall-clock cap for the target phase")
    p.add_argument("--draft-minutes", type=float, default=None, help="wall-clock cap for the drafter phase")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--target-d-model", type=int, default=256)
    p.add_argument("--target-layers", type=int, default=20)
    p.add_argument("--target-attn-layers", default="10", help="comma-separated attention layer indices")
    p.add_argument("--draft-d-model", type=int, default=256)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--d-state", type=int, default=64)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--tokenizer-bytes", type=int, default=8_000_000, help="text the BPE is trained on")
    p.add_argument("--device", default=None)
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager training steps on CUDA")
    p.add_argument("--drafter", choices=["pair", "treeflash"], default="pair",
                   help="pair: train the target and distil the Mamba2 drafter; treeflash: distil a TreeFlash "
                        "drafter from the trained target (--target) into OUT/demo-treeflash")
    p.add_argument("--target", default=None, type=model_folder_arg,
                   help="treeflash: the trained target, a folder or Hub id (default OUT/demo-target)")
    p.add_argument("--treeflash-d-model", type=int, default=DEFAULT_D_MODEL)
    p.add_argument("--treeflash-depth", type=int, default=DEFAULT_DEPTH, help="treeflash: depths drafted in one pass")
    p.add_argument("--treeflash-layers", type=int, default=DEFAULT_N_LAYER)
    p.add_argument("--replot", default=None, metavar="DIR", help="only redraw DIR's loss plot from its train_log.json")
    _corpus_options(p)
    p.set_defaults(func=train_command)

    c = sub.add_parser("corpus", help="write the offline training corpus (site-packages sources) as JSONL")
    c.add_argument("--out", required=True, help="JSONL file, one {\"text\": ...} per document")
    c.add_argument("--split", choices=["train", "val"], default="train")
    _corpus_options(c)
    c.set_defaults(func=corpus_command)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="stree")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
