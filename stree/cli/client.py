"""``stree client generate|health``: call a running ``stree serve`` (or check a drafter service's health)."""

from __future__ import annotations

import json
import sys

from stree.protocols.drafter import DraftBudget

from stree.cli.generate import parse_prompt_ids


def run_generate(args) -> int:
    import grpc

    try:
        return _generate(args)
    except grpc.RpcError as exc:
        print(f"stree client: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


def _generate(args) -> int:
    from stree.verifier.service.client import Client

    kwargs = dict(
        prompt=args.prompt, prompt_ids=parse_prompt_ids(args.prompt_ids) if args.prompt_ids else None,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id, drafter=args.drafter or "",
        ignore_eos=args.ignore_eos,
    )
    if args.max_nodes or args.max_depth or args.max_width:
        kwargs["budget"] = DraftBudget(max_nodes=args.max_nodes or 16, max_depth=args.max_depth or 8,
                                       max_width=args.max_width or 4)
    with Client(args.server, timeout=args.timeout) as client:
        if args.stream:
            ids, stats, reason = [], {}, ""
            for chunk in client.stream(**kwargs):
                ids.extend(chunk.token_ids)
                if args.json:
                    print(json.dumps({"token_ids": chunk.token_ids, "text": chunk.text, "step": chunk.step,
                                      "finished": chunk.finished, "finish_reason": chunk.finish_reason,
                                      "stats": chunk.stats}), flush=True)
                else:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                stats, reason = chunk.stats or stats, chunk.finish_reason or reason
            if not args.json:
                print()
                _summary(ids, stats, reason)
            return 0
        out = client.generate(**kwargs)
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                          "stats": out.stats}))
    else:
        print(out.text if out.text else " ".join(map(str, out.token_ids)))
        _summary(out.token_ids, out.stats, out.finish_reason)
    return 0


def run_health(args) -> int:
    """Print the server's health status; exit 0 only when SERVING (handy in scripts)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.server) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout or 5.0)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as exc:
            status = f"UNREACHABLE ({exc.code().name})"
    print(status)
    return 0 if status == "SERVING" else 1


def _summary(ids: list[int], stats: dict, reason: str) -> None:
    print(f"[{stats.get('drafter', '?')}] {len(ids)} tokens in {stats.get('steps', 0)} steps "
          f"({reason}), mean accepted length {stats.get('mean_accepted_length', 0.0):.2f}, "
          f"{stats.get('tokens_per_s', 0.0):.1f} tok/s, {stats.get('fallbacks', 0)} drafter fallbacks",
          file=sys.stderr)


def add_parser(sub) -> None:
    p = sub.add_parser("client", help="call a running stree server")
    csub = p.add_subparsers(dest="client_command", metavar="ACTION")
    csub.required = True
    g = csub.add_parser("generate", help="generate text through a GenerationService")
    g.add_argument("--server", required=True, metavar="HOST:PORT")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT")
    src.add_argument("--prompt-ids", metavar="1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--drafter", default=None, help="drafter name for this request ('none': plain decoding)")
    g.add_argument("--max-nodes", type=int, default=None)
    g.add_argument("--max-depth", type=int, default=None)
    g.add_argument("--max-width", type=int, default=None)
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    g.add_argument("--json", action="store_true", help="JSON output (one object per chunk with --stream)")
    g.add_argument("--timeout", type=float, default=None, help="seconds")
    g.set_defaults(func=run_generate)
    h = csub.add_parser("health", help="grpc.health.v1 status of a stree server (GenerationService or DrafterService)")
    h.add_argument("--server", required=True, metavar="HOST:PORT")
    h.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    h.add_argument("--timeout", type=float, default=None, help="seconds")
    h.set_defaults(func=run_health)
