"""``stree drafter-service``: host drafter plugins as Ray actors behind the gRPC DrafterService."""

from __future__ import annotations

import argparse
import json
import logging


def parse_options(items: list[str]) -> dict[str, dict]:
    """``KEY=VALUE`` (every drafter) or ``NAME.KEY=VALUE`` (drafter NAME); values parse as JSON when they can."""
    out: dict[str, dict] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option wants KEY=VALUE or NAME.KEY=VALUE, got {item!r}")
        name, dot, opt = key.rpartition(".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name if dot else "*", {})[opt] = value
    return out


def options_function(draft_model: str | None, options: dict[str, dict]):
    """``name -> options`` for the drafter host: ``draft_model`` plus the generic and per-name options."""

    def options_for(name: str) -> dict:
        opts = {}
        if draft_model:
            opts["draft_model"] = draft_model
        opts.update(options.get("*", {}))
        opts.update(options.get(name, {}))
        return opts

    return options_for


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "drafter-service",
        help="serve drafters (Ray actors) over gRPC",
        description="Run drafter plugins as Ray actor replicas behind the stree.v1.DrafterService gRPC API.",
    )
    p.add_argument("--port", type=int, default=50061, help="port to listen on (0: any free port)")
    p.add_argument("--bind", default="0.0.0.0", help="interface to listen on (default 0.0.0.0)")
    p.add_argument("--ray-address", default="local",
                   help="'local' starts a private Ray instance, 'auto' joins the running cluster, or HOST:PORT")
    p.add_argument("--ray-num-cpus", type=int, default=2, help="CPUs of a 'local' Ray instance")
    p.add_argument("--drafters", default="",
                   help="comma-separated drafters to start up front (others start on first use)")
    p.add_argument("--draft-model", default=None, help="checkpoint dir for model drafters (mamba, chain, static-tree)")
    p.add_argument("--option", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="drafter option, e.g. chain.num_speculative_tokens=6 (repeatable)")
    p.add_argument("--replicas", type=int, default=2, help="Ray actor replicas per drafter")
    p.add_argument("--max-restarts", type=int, default=3, help="Ray restarts of a crashed replica")
    p.add_argument("--cpus-per-replica", type=float, default=0.0, help="Ray CPUs reserved per replica")
    p.add_argument("--gpus-per-replica", type=float, default=1.0,
                   help="GPUs per model-drafter replica when the cluster has GPUs")
    p.add_argument("--replica-resources", default="{}", metavar="JSON",
                   help='custom Ray resources each replica needs, e.g. \'{"stree_drafter": 1}\' to keep replicas '
                        "on the nodes that offer it")
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds before a replica call counts as failed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stree.proto.rpc import serve_until_signalled
    from stree.drafter_service.actors import PoolConfig, init_ray
    from stree.drafter_service.service import DrafterServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = parse_options(args.option)
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    try:
        resources = json.loads(args.replica_resources)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--replica-resources is not JSON: {exc}") from None
    if not isinstance(resources, dict) or not all(isinstance(v, (int, float)) for v in resources.values()):
        raise ValueError(f"--replica-resources wants a JSON object of numbers, got {args.replica_resources!r}")
    config = PoolConfig(
        replicas=args.replicas,
        resources=resources,
        max_restarts=args.max_restarts,
        num_cpus=args.cpus_per_replica,
        num_gpus=args.gpus_per_replica,
    )
    init_ray(args.ray_address, num_cpus=args.ray_num_cpus)
    server = DrafterServer(
        port=args.port,
        bind=args.bind,
        drafters=drafters,
        options_for=options_function(args.draft_model, options),
        pool_config=config,
        call_timeout_s=args.call_timeout,
    )
    serve_until_signalled(server, "stree drafter-service listening on {address}")
    print("stree drafter-service: stopped", flush=True)
    return 0
