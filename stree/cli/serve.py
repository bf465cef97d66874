"""``stree serve``: the GenerationService (gRPC) and, with ``--http-port``, the OpenAI-compatible HTTP API
for a checkpoint, both on one continuously batched engine; drafting in-process or through a DrafterService.

On SIGTERM (or SIGINT) the server drains: it reports NOT_SERVING, refuses new requests (UNAVAILABLE / 503),
lets requests in flight finish for up to ``--drain-timeout`` seconds, ends the rest with an error, then exits."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from stree.kernels import numerics

from stree.cli.drafter_service import options_function, parse_options
from stree.protocols.drafter import DEFAULT_BUDGET, DraftBudget
from stree.verifier.decode.engine import ADMIT_HOLD_STEPS
from stree.verifier.model.hub import ModelFolder, model_folder_arg
from stree.verifier.model.lm import DTYPES, SSM_CACHE_DTYPES



def build_server(args):
    if args.numerics:
        numerics.use(args.numerics)
    """A ``GenerationServer`` from parsed arguments (loads the model; does not start it)."""
    from stree.proto.rpc import api_key_from_env
    from stree.verifier.model.checkpoint import load_draft_model, load_model
    from stree.verifier.model.treeflash import TreeFlashNet
    from stree.verifier.service.remote_drafter import MAX_OVERLAP
    from stree.verifier.service.server import EmbeddedDrafters, GenerationServer, RemoteDrafters, ServerLimits
    from stree.verifier.model.generation_settings import load_generation_settings
    from stree.proto.rpc import api_key_from_env

    remote = bool(args.drafter and args.drafter.startswith("grpc://"))
    if not 0 <= args.draft_ahead <= MAX_OVERLAP:
        raise ValueError(f"--draft-ahead must be from 0 to {MAX_OVERLAP} trees, got {args.draft_ahead}")
    if args.draft_ahead and not remote:
        raise ValueError("--draft-ahead is for a remote drafter (--drafter grpc://HOST:PORT/NAME)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model_dir, device=device, dtype=DTYPES[args.dtype])
    model.set_mamba_ssm_cache_dtype(args.mamba_ssm_cache_dtype)
    settings = load_generation_settings(args.model_dir, args.tokenizer)
    tokenizer = settings.tokenizer
    budget = DraftBudget(
        max_nodes=args.max_nodes or DEFAULT_BUDGET.max_nodes,
        max_depth=args.max_depth or DEFAULT_BUDGET.max_depth,
        max_width=args.max_width or DEFAULT_BUDGET.max_width,
    )
    if args.deadline_ms <= 0:
        raise ValueError(f"--deadline-ms must be > 0, got {args.deadline_ms}")
    if remote:
        if args.draft_model:
            raise ValueError("--draft-model is for in-process drafters; give it to `stree drafter-service`")
        drafters = RemoteDrafters(args.drafter, args.deadline_ms / 1e3, budget, overlap=args.draft_ahead)
    else:
        draft = load_draft_model(args.draft_model, device=device, dtype=DTYPES[args.dtype]) if args.draft_model else None
        default = args.drafter or ("ngram" if draft is None else "treeflash" if isinstance(draft, TreeFlashNet)
                                   else "mamba")
        options = options_function(None, parse_options(args.option))(default)
        drafters = EmbeddedDrafters(default, draft_model=draft, options=options)
    limits = ServerLimits(
        max_sessions=args.max_sessions, max_waiting=args.max_waiting, max_seq_len=args.max_seq_len,
        default_max_new_tokens=args.default_max_new_tokens, max_new_tokens=args.max_new_tokens_limit,
        max_prompt_chars=args.max_prompt_chars, max_num_samples=args.max_num_samples,
        max_streams_per_client=args.max_streams_per_client, prefill_chunk=args.prefill_chunk, budget=budget,
        admit_hold_steps=args.admit_hold_steps, max_prompt_bytes=args.max_prompt_bytes,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout, reserved_slots=args.reserved_slots,
    )
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()) if args.tls_cert else None
    return GenerationServer(
        model, tokenizer, drafters, port=args.port, bind=args.host, limits=limits,
        model_name=_served_name(args), eos_id=settings.eos_token_ids,
        metrics_port=args.metrics_port, tls=tls, http_port=args.http_port, model_dir=args.model_dir,
        api_key=api_key_from_env(args.api_key), drain_timeout=args.drain_timeout,
    )


def _served_name(args) -> str:
    """``--served-model-name``, else the Hub id MODEL_DIR came from, else its folder name."""
    if args.served_model_name:
        return args.served_model_name
    folder = args.model_dir
    return folder.display_name if isinstance(folder, ModelFolder) else Path(folder).name


def run(args) -> int:
    from stree.proto.rpc import serve_until_signalled

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(args)
    banner = "stree serve: gRPC on {address}"
    if args.http_port is not None:
        banner += " and OpenAI-compatible HTTP on {server.http.address} (/v1)"
    if args.metrics_port is not None:
        banner += f" (metrics on :{args.metrics_port}/metrics)"
    serve_until_signalled(server, banner, stop_timeout=args.drain_timeout + 30)
    print("stree serve: stopped", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC and an OpenAI-compatible HTTP API",
                       description="Serve MODEL_DIR over the stree.v1.GenerationService gRPC API and, with "
                                   "--http-port, an OpenAI-compatible HTTP API, on one continuously batched engine.")
    p.add_argument("model_dir", metavar="MODEL_DIR", type=model_folder_arg,
                   help="checkpoint folder or Hugging Face Hub id (ORG/NAME)")
    p.add_argument("--tokenizer", metavar="DIR", default=None, type=model_folder_arg,
                   help="folder with tokenizer.json / tokenizer_config.json (default: MODEL_DIR)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--http-port", type=int, default=None, help="OpenAI-compatible HTTP port (off unless given)")
    p.add_argument("--host", "--bind", dest="host", default="127.0.0.1",
                   help="interface to listen on; 0.0.0.0 exposes the server to the network")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", default=None,
                   help="model id of the HTTP API and metrics label (default: the Hub id, or MODEL_DIR's folder name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on HTTP /v1 and every gRPC method but health probes "
                        "(default: $STREE_API_KEY)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="TLS certificate chain (gRPC and HTTP)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="TLS private key (gRPC and HTTP)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may take to finish before they are ended")
    p.add_argument("--drafter", metavar="NAME|grpc://HOST:PORT/NAME",
                   help="default drafter: an in-process plugin name, 'none', or a DrafterService URL "
                        "(default: mamba with --draft-model, treeflash with a TreeFlash checkpoint, else ngram)")
    p.add_argument("--draft-model", metavar="DIR", type=model_folder_arg,
                   help="draft model checkpoint (folder or Hub id) for in-process model drafters (or a TreeFlash "
                        "checkpoint)")
    p.add_argument("--option", action="append", default=[], metavar="[NAME.]KEY=VALUE",
                   help="in-process drafter option, e.g. tree=beam:4x3 (repeatable)")
    p.add_argument("--deadline-ms", type=float, default=50.0,
                   help="remote drafter: wait at most this long for a tree, then run the step without one")
    p.add_argument("--draft-ahead", type=int, default=0, metavar="N",
                   help="remote drafter: let the service draft up to N trees ahead while a tree is verified, for the "
                        "likeliest outcomes (0: off; the service grants at most its own limit)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--max-sessions", type=int, default=8, help="engine slots: requests generated together")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests queued for a slot; more get RESOURCE_EXHAUSTED / HTTP 429")
    p.add_argument("--max-seq-len", type=int, default=8192, help="prompt + new tokens limit per request")
    p.add_argument("--default-max-new-tokens", type=int, default=128, help="when a request sets none")
    p.add_argument("--max-new-tokens-limit", type=int, default=4096, help="largest max_new_tokens / max_tokens")
    p.add_argument("--max-prompt-chars", type=int, default=4_000_000, help="longest prompt text")
    p.add_argument("--max-prompt-bytes", type=int, default=None,
                   help="largest prompt text in UTF-8 bytes, refused before tokenizing (default: --max-seq-len "
                        "x the bytes of the tokenizer's longest entry, at most 8)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest HTTP request body (default: room for the largest prompt, JSON-escaped)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds an HTTP request body may take to arrive (408 after)")
    p.add_argument("--reserved-slots", type=int, default=None,
                   help="engine slots kept for clients that run nothing yet, so a newcomer starts at once while "
                        "others hold long generations (default: --max-sessions // 8; 0: none)")
    p.add_argument("--max-num-samples", type=int, default=4, help="largest OpenAI n")
    p.add_argument("--max-streams-per-client", type=int, default=16,
                   help="generations one client address may have running or queued (gRPC and HTTP)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens prefilled between cancel checks")
    p.add_argument("--admit-hold-steps", type=int, default=ADMIT_HOLD_STEPS,
                   help="at most this many steps free slots may wait, while more requests queue than slots are free, for running "
                        "sequences about to finish, so that queued prompts share one prefill (measured costs set the "
                        "hold below this; 0: admit at once)")
    p.add_argument("--max-nodes", type=int, default=None, help="default draft budget: nodes per tree")
    p.add_argument("--max-depth", type=int, default=None, help="default draft budget: tree depth")
    p.add_argument("--max-width", type=int, default=None, help="default draft budget: children per node")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--numerics", choices=["exact", "fast"], default=None,
                   help="exact: speculative output equals plain decoding bit for bit in every dtype; fast: per-shape "
                        "timed kernels whose rounding follows the tree (default: $STREE_NUMERICS, else exact)")
    p.add_argument("--mamba-ssm-cache-dtype", choices=SSM_CACHE_DTYPES, default="float32",
                   help="SSM state dtype (auto: the model's); float32 is exact, a half state halves its traffic")
    p.set_defaults(func=run)
