"""The ``stree`` console script: one subcommand per job, each defined beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

from stree.cli.help_format import use_defaults_once

# Modules that define ``add_parser(subparsers)``; each registers one or more subcommands.
COMMAND_MODULES = [
    "stree.cli.bench",
    "stree.cli.generate",
    "stree.cli.init_model",
    "stree.cli.demo",
    "stree.cli.train",
    "stree.cli.datastore",
    "stree.cli.drafter_service",
    "stree.cli.serve",
    "stree.cli.client",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stree",
        description="Speculative tree decoding for Mamba2 and hybrid Mamba2+attention models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    use_defaults_once(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for commands that re-run themselves (supervise)
    try:
        rc = args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        # Bad input (a checkpoint, a tree, an option): say what is wrong, no traceback.
        print(f"stree {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
