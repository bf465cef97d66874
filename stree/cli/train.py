"""``stree train`` (train a target and distil its Mamba2 drafter), ``stree train drafter`` (distil a drafter for any
target) and ``stree corpus`` (dump the corpus as JSONL).

One command for one GPU or many: under ``torchrun`` each process takes its rank from the environment, and
``--gpus N`` re-runs the same command under ``torch.distributed.run`` with N processes (gloo on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from stree.cli.init_model import parse_layer_list

from stree.training.corpus import ALL_PACKAGES, DEFAULT_PACKAGES, MAX_FILE_BYTES, build_corpus
from stree.training.distill import DATA, KINDS, DrafterConfig, train_drafter
from stree.training.distributed import DistEnv, relaunch
from stree.training.model_shape import Shape
from stree.training.run_settings import RunSettings
from stree.training.train import LOG_FILE, PLOT_FILE, TrainConfig, plot_losses, train_pair
from stree.verifier.model.hub import model_folder_arg
from stree.verifier.model.treeflash import DEFAULT_DEPTH


def _without_gpus(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--gpus", "--nproc"):
            skip = True
        elif not a.startswith(("--gpus=", "--nproc=")):
            out.append(a)
    return out


def _relaunched(args) -> int | None:
    """The exit code of this command re-run under torchrun with ``--gpus`` processes, or None to run here."""
    if args.gpus > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch(args.gpus, "stree.cli", _without_gpus(args.argv))
    return None


def _run_settings(args) -> RunSettings:
    return RunSettings(compile=args.compile, recompute=args.recompute, micro_batch=args.micro_batch,
                       cuda_graphs=not args.no_cuda_graphs, resume=args.resume, save_every=args.save_every,
                       workers=args.workers, peak_tflops=args.peak_tflops)


def _packages(args) -> tuple:
    return tuple(args.packages.split(","))


def _last(log: dict) -> dict:
    return log["evals"][-1][1] if log.get("evals") else {}


def _throughput(log: dict) -> str:
    mfu = f", MFU {100 * log['mfu']:.1f}%" if log.get("mfu") else ""
    return f"{log['tokens_per_s']:,} tokens/s{mfu}" if log.get("tokens_per_s") else "-"


def train_command(args) -> int:
    if args.replot:
        log_path = Path(args.replot) / LOG_FILE
        plot_losses(json.loads(log_path.read_text()), Path(args.replot) / PLOT_FILE)
        print(f"wrote {Path(args.replot) / PLOT_FILE}")
        return 0
    rc = _relaunched(args)
    if rc is not None:
        return rc
    env = DistEnv.from_env(args.device)
    cfg = TrainConfig(
        out=args.out, prefix=args.prefix, vocab_size=args.vocab_size,
        target=Shape(args.target_d_model, args.target_layers,
                     tuple(parse_layer_list(args.target_attn_layers, "--target-attn-layers")), args.d_state,
                     args.headdim),
        draft=Shape(args.draft_d_model, args.draft_layers, (), args.d_state, args.headdim),
        target_steps=args.steps, draft_steps=args.steps if args.draft_steps is None else args.draft_steps,
        batch_size=args.batch_size, seq_len=args.seq_len, target_lr=args.lr, draft_lr=args.draft_lr,
        warmup=args.warmup, target_minutes=args.target_minutes, draft_minutes=args.draft_minutes,
        eval_every=args.eval_every, eval_batches=args.eval_batches, packages=_packages(args),
        corpus_bytes=args.corpus_bytes, max_file_bytes=args.max_file_bytes, tokenizer_bytes=args.tokenizer_bytes,
        corpus_roots=args.corpus_root,
        cache_dir=args.cache_dir, rescale_residual=args.rescale_residual, device=env.device.type, seed=args.seed,
        run=_run_settings(args),
    )
    try:
        log = train_pair(cfg, env)
    finally:
        env.close()
    if env.is_main:
        t, d = log["target"], log["draft"]
        print(f"target: {t['steps']} steps in {t['seconds']}s ({_throughput(t)}), final val {_last(t) or '-'}")
        if d is not None:
            print(f"draft:  {d['steps']} steps in {d['seconds']}s ({_throughput(d)}), final val {_last(d) or '-'}")
        sizes = ", ".join(f"{cfg.out}/{cfg.prefix}-{k} ({v / 1e6:.1f} MB)" for k, v in log["checkpoint_bytes"].items())
        print(f"checkpoints: {sizes}")
    return 0


def drafter_command(args) -> int:
    rc = _relaunched(args)
    if rc is not None:
        return rc
    env = DistEnv.from_env(args.device)
    out = args.out or f"{str(args.target).rstrip('/')}-{args.kind}-drafter"
    cfg = DrafterConfig(
        target=args.target, out=out, kind=args.kind, layers=args.layers, d_model=args.d_model, d_state=args.d_state,
        headdim=args.headdim, depth=args.depth, data=args.data, gen_sequences=args.gen_sequences,
        prompt_len=args.prompt_len, steps=args.steps, minutes=args.minutes, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, eval_every=args.eval_every,
        eval_batches=args.eval_batches, packages=_packages(args), corpus_bytes=args.corpus_bytes,
        max_file_bytes=args.max_file_bytes, corpus_roots=args.corpus_root, cache_dir=args.cache_dir,
        device=env.device.type, seed=args.seed, run=_run_settings(args))
    try:
        log = train_drafter(cfg, env)
    finally:
        env.close()
    if env.is_main:
        last = _last(log)
        print(f"{args.kind} drafter ({log['params'] / 1e6:.2f}M params): {log['steps']} steps in {log['seconds']}s "
              f"({_throughput(log)}); val KL {last.get('val_kl', float('nan')):.4f}, top-1 agreement "
              f"{last.get('val_top1_agreement', float('nan')):.3f}")
        print(f"checkpoint: {out} ({log['checkpoint_bytes'] / 1e6:.1f} MB); use it with --draft-model {out}")
    return 0


def corpus_command(args) -> int:
    corpus = build_corpus(_packages(args), args.corpus_bytes, roots=args.corpus_root, seed=args.seed,
                          max_file_bytes=args.max_file_bytes)
    path = corpus.write_jsonl(args.out, args.split)
    print(f"{path}: {len(getattr(corpus, args.split))} documents ({args.split} split) of "
          f"{corpus.meta['files']} files, {corpus.meta['bytes'] / 1e6:.1f} MB in all")
    return 0


def _corpus_options(p, corpus_bytes: int = 24_000_000) -> None:
    p.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                   help=f"installed packages whose .py/.pyi/.md/.rst/.txt files form the corpus ('{ALL_PACKAGES}': "
                        "every package and the standard library)")
    p.add_argument("--corpus-bytes", type=int, default=corpus_bytes, help="corpus size cap (bytes of text)")
    p.add_argument("--max-file-bytes", type=int, default=MAX_FILE_BYTES, help="larger files are skipped")
    p.add_argument("--corpus-root", action="append", default=None, metavar="DIR",
                   help="read the packages (or with --packages all, every text file) under DIR instead of "
                        "site-packages; repeatable")
    p.add_argument("--seed", type=int, default=0)


def _run_options(p) -> None:
    p.add_argument("--gpus", "--nproc", type=int, default=1, dest="gpus",
                   help="data-parallel processes: re-runs this command under torchrun (one per GPU; gloo on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the elementwise work around the SSD")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing per block (less memory)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="windows per micro-batch on each process (gradient accumulation; default: all of its share)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager training steps on CUDA")
    p.add_argument("--resume", action="store_true", help="continue from OUT's resume checkpoints")
    p.add_argument("--save-every", type=int, default=0, help="steps between resume checkpoints (0: none)")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every CPU)")
    p.add_argument("--cache-dir", default=None, help="tokenizer and token-id cache (default ~/.cache/stree)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-card bf16 peak for MFU (default: by name)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation")


def add_parser(sub) -> None:
    p = sub.add_parser("train", allow_abbrev=False,  # no prefix matching: `drafter`'s --target is not --target-*
                       help="train a hybrid target and distil a Mamba2 drafter from it; "
                            "`stree train drafter`: a drafter for any target")
    p.add_argument("--out", default="checkpoints", help="writes OUT/<prefix>-target, OUT/<prefix>-draft, log, plot")
    p.add_argument("--prefix", default="demo", help="checkpoint folder names: <prefix>-target, <prefix>-draft")
    p.add_argument("--steps", type=int, default=2000, help="target training steps")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="drafter distillation steps (default: --steps; 0: no drafter)")
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
    p.add_argument("--batch-size", type=int, default=32, help="global batch (windows per step over all processes)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--tokenizer-bytes", type=int, default=8_000_000, help="text the BPE is trained on")
    p.add_argument("--rescale-residual", action="store_true", help="init out_proj / sqrt(layers) (deep targets)")
    p.add_argument("--replot", default=None, metavar="DIR", help="only redraw DIR's loss plot from its train_log.json")
    _run_options(p)
    _corpus_options(p)
    p.set_defaults(func=train_command)

    sub2 = p.add_subparsers(dest="train_what", metavar="{drafter}")
    d = sub2.add_parser("drafter", allow_abbrev=False,
                        help="distil a Mamba2 drafter or a TreeFlash head from any target stree loads")
    d.add_argument("--target", required=True, type=model_folder_arg,
                   help="the target: a folder (mamba_ssm format or a Hugging Face model) or a Hub id (ORG/NAME)")
    d.add_argument("--kind", choices=KINDS, default="mamba")
    d.add_argument("--out", default=None, help="the drafter's checkpoint folder (default TARGET-KIND-drafter)")
    d.add_argument("--layers", type=int, default=None, help="mamba: Mamba2 layers (2); treeflash: mixer blocks (2)")
    d.add_argument("--d-model", type=int, default=None, help="mamba: min(512, target's); treeflash: 128")
    d.add_argument("--d-state", type=int, default=64)
    d.add_argument("--headdim", type=int, default=64)
    d.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="treeflash: depths drafted per pass")
    d.add_argument("--data", choices=DATA, default="corpus",
                   help="corpus: the offline corpus in the target's tokenization; generated: the target's own samples")
    d.add_argument("--gen-sequences", type=int, default=2048, help="--data generated: sequences sampled")
    d.add_argument("--prompt-len", type=int, default=16, help="--data generated: corpus tokens each sample starts from")
    d.add_argument("--steps", type=int, default=2000)
    d.add_argument("--minutes", type=float, default=None, help="wall-clock cap")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--warmup", type=int, default=100)
    d.add_argument("--eval-every", type=int, default=200)
    _run_options(d)
    d.set_defaults(eval_batches=2)
    _corpus_options(d)
    d.set_defaults(func=drafter_command)

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
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
