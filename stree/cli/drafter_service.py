"""``stree drafter-service``: host drafter plugins as Ray actors behind the gRPC DrafterService."""

from __future__ import annotations

import argparse
import json
import logging

from stree.verifier.model.hub import model_folder_arg
from stree.verifier.model.lm import DTYPES


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
    p.add_argument("--host", "--bind", dest="host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface, "
                        "then use --tls-* and --api-key)")
    p.add_argument("--tls-cert", default=None, help="PEM server certificate (TLS; with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA that client certificates must chain to (mTLS)")
    p.add_argument("--api-key", default=None,
                   help="require 'authorization: Bearer KEY' on every call but health probes "
                        "(default: $STREE_API_KEY; unset: no key)")
    p.add_argument("--on-demand", action="store_true",
                   help="serve any registered drafter on first use (default: only --drafters)")
    p.add_argument("--max-context", type=int, default=262_144, help="most tokens of one session's context")
    p.add_argument("--max-sessions", type=int, default=1024, help="most open sessions, all clients together")
    p.add_argument("--ray-address", default="local",
                   help="'local' starts a private Ray instance, 'auto' joins the running cluster, or HOST:PORT")
    p.add_argument("--ray-num-cpus", type=int, default=2, help="CPUs of a 'local' Ray instance")
    p.add_argument("--ray-node-ip", default="127.0.0.1",
                   help="address every process of a 'local' Ray instance listens on (GCS, raylet, workers, "
                        "agents; default 127.0.0.1: this machine only)")
    p.add_argument("--drafters", default="",
                   help="comma-separated drafters to start up front (others start on first use)")
    p.add_argument("--draft-model", default=None, type=model_folder_arg,
                   help="checkpoint folder or Hub id for model drafters (mamba, chain, static-tree)")
    p.add_argument("--option", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="drafter option, e.g. chain.num_speculative_tokens=6 (repeatable)")
    p.add_argument("--replicas", type=int, default=2, help="Ray actor replicas per drafter")
    p.add_argument("--max-restarts", type=int, default=3, help="Ray restarts of a crashed replica")
    p.add_argument("--cpus-per-replica", type=float, default=0.0, help="Ray CPUs reserved per replica")
    p.add_argument("--gpus-per-replica", type=float, default=1.0,
                   help="GPUs per model-drafter replica when the cluster has GPUs")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where model drafters run: auto (a GPU when the cluster has one, else the CPU), cpu, or cuda "
                        "(a replica without a GPU refuses to start)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="model drafters' weights (default: each checkpoint's own dtype)")
    p.add_argument("--replica-resources", default="{}", metavar="JSON",
                   help='custom Ray resources each replica needs, e.g. \'{"stree_drafter": 1}\' to keep replicas '
                        "on the nodes that offer it")
    p.add_argument("--no-supervise", action="store_true",
                   help="serve in this process (default: in a child process group that is cleaned up on exit, so "
                        "no Ray process outlives the service even when it is killed)")
    p.add_argument("--call-timeout", type=float, default=30.0, help="seconds before a replica call counts as failed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stree.cli.supervise import is_supervised, run_supervised

    if not args.no_supervise and not is_supervised():
        return run_supervised(args.argv)
    import ray

    from stree.proto.rpc import api_key_from_env, serve_until_signalled, server_credentials
    from stree.drafter_service.actors import PoolConfig, init_ray
    from stree.drafter_service.service import DrafterServer, ServiceLimits

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
        device=args.device,
        dtype=args.dtype,
    )
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if not drafters and not args.on_demand:
        raise ValueError("name the drafters to serve with --drafters (or pass --on-demand)")
    if args.max_context < 1 or args.max_sessions < 1:
        raise ValueError("--max-context and --max-sessions must be >= 1")
    limits = ServiceLimits(max_context_tokens=args.max_context, max_sessions=args.max_sessions,
                           max_sessions_per_client=min(256, args.max_sessions))
    init_ray(args.ray_address, num_cpus=args.ray_num_cpus, node_ip=args.ray_node_ip)
    server = DrafterServer(
        port=args.port,
        bind=args.host,
        drafters=drafters,
        options_for=options_function(args.draft_model, options),
        pool_config=config,
        call_timeout_s=args.call_timeout,
        limits=limits,
        credentials=credentials,
        api_key=api_key_from_env(args.api_key),
        on_demand=args.on_demand,
    )
    try:
        serve_until_signalled(server, "stree drafter-service listening on {address}")
    finally:
        ray.shutdown()
    print("stree drafter-service: stopped", flush=True)
    return 0
