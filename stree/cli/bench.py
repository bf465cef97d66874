"""``stree bench ...``: one ``bench`` subcommand whose sub-subcommands live beside the code they measure.

A benchmark module defines ``add_parser(bench_subparsers)`` and is listed in ``BENCH_MODULES``.
"""

from __future__ import annotations

import importlib

# Modules that define ``add_parser(sub)`` registering one ``stree bench <name>`` each.
BENCH_MODULES = [
    "stree.bench.kernels",
    "stree.bench.drafters",
    "stree.bench.rpc",
    "stree.bench.e2e",
    "stree.bench.oracle",
    "stree.bench.batch",
    "stree.bench.step_profile",
    "stree.bench.serve",
    "stree.bench.admission",
    "stree.bench.isolation",
    "stree.bench.scale_pair",
    "stree.bench.numerics",
    "stree.bench.distributed",
    "stree.bench.merge",
]


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (kernels, drafters, e2e, oracle, batch, step-profile, "
                                                "rpc, serve, admission, isolation, scale-pair, numerics, "
                                                "distributed, merge)")
    sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name in BENCH_MODULES:
        importlib.import_module(name).add_parser(sub)
