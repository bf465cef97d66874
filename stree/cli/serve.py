"""``stree serve``: run the GenerationService for a checkpoint, drafting in-process or through a DrafterService."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from stree.cli.drafter_service import options_function, parse_options
from stree.protocols.drafter import DraftBudget

from stree.protocols.drafter import DEFAULT_BUDGET

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_server(args):
    """A ``GenerationServer`` from parsed arguments (loads the model; does not start it)."""
    from stree.verifier.model.checkpoint import load_model
    from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, RemoteDrafters, ServerLimits
    from stree.verifier.model.generation_settings import load_generation_settings

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model_dir, device=device, dtype=DTYPES[args.dtype])
    settings = load_generation_settings(args.model_dir, args.tokenizer)
    tokenizer = settings.tokenizer
    budget = DraftBudget(
        max_nodes=args.max_nodes or DEFAULT_BUDGET.max_nodes,
        max_depth=args.max_depth or DEFAULT_BUDGET.max_depth,
        max_width=args.max_width or DEFAULT_BUDGET.max_width,
    )
    if args.deadline_ms <= 0:
        raise ValueError(f"--deadline-ms must be > 0, got {args.deadline_ms}")
    if args.drafter and args.drafter.startswith("grpc://"):
        if args.draft_model:
            raise ValueError("--draft-model is for in-process drafters; give it to `stree drafter-service`")
        drafters = RemoteDrafters(args.drafter, args.deadline_ms / 1e3, budget)
    else:
        draft = load_model(args.draft_model, device=device, dtype=DTYPES[args.dtype]) if args.draft_model else None
        default = args.drafter or ("mamba" if draft is not None else "ngram")
        options = options_function(None, parse_options(args.option))(default)
        drafters = EmbeddedDrafters(default, draft_model=draft, options=options)
    limits = ServerLimits(
        max_sessions=args.max_sessions, max_seq_len=args.max_seq_len,
        default_max_new_tokens=args.default_max_new_tokens, max_new_tokens=args.max_new_tokens_limit, budget=budget,
    )
    return GenerationServer(
        model, tokenizer, drafters, port=args.port, bind=args.bind, limits=limits,
        model_name=args.model_name or Path(args.model_dir).name, eos_id=settings.eos_token_ids,
        metrics_port=args.metrics_port,
    )


def run(args) -> int:
    from stree.proto.rpc import serve_until_signalled

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(args)
    banner = "stree serve listening on {address}"
    if args.metrics_port is not None:
        banner += f" (metrics on :{args.metrics_port}/metrics)"
    serve_until_signalled(server, banner)
    print("stree serve: stopped", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC (GenerationService)",
                       description="Serve MODEL_DIR over the stree.v1.GenerationService gRPC API.")
    p.add_argument("model_dir", metavar="MODEL_DIR")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="folder with tokenizer.json / tokenizer_config.json (default: MODEL_DIR)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (0: any free port)")
    p.add_argument("--bind", default="0.0.0.0", help="interface to listen on (default 0.0.0.0)")
    p.add_argument("--drafter", metavar="NAME|grpc://HOST:PORT/NAME",
                   help="default drafter: an in-process plugin name, 'none', or a DrafterService URL "
                        "(default: mamba with --draft-model, else ngram)")
    p.add_argument("--draft-model", metavar="DIR", help="draft model checkpoint for in-process model drafters")
    p.add_argument("--option", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="in-process drafter option, e.g. tree=beam:4x3 (repeatable)")
    p.add_argument("--deadline-ms", type=float, default=50.0,
                   help="remote drafter: wait at most this long for a tree, then run the step without one")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--max-sessions", type=int, default=8, help="concurrent generations")
    p.add_argument("--max-seq-len", type=int, default=8192, help="prompt + new tokens limit per request")
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens-limit", type=int, default=4096)
    p.add_argument("--max-nodes", type=int, default=None, help="default draft budget: nodes per tree")
    p.add_argument("--max-depth", type=int, default=None, help="default draft budget: tree depth")
    p.add_argument("--max-width", type=int, default=None, help="default draft budget: children per node")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--model-name", default=None, help="model_name label of the metrics (default: MODEL_DIR's name)")
    p.set_defaults(func=run)
