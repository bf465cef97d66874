"""``stree init-model``: write a random Mamba2 or hybrid checkpoint (with a tokenizer) that loads back."""

from __future__ import annotations

import json

from stree.verifier.model.checkpoint import init_model, load_model


def parse_layer_list(text: str, flag: str = "--attn-layers") -> list[int]:
    """Layer indices from ``"3,7"``; a clear error naming ``flag`` otherwise."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} wants comma-separated layer indices, got {text!r}") from None


def run(args) -> int:
    out = init_model(
        args.out_dir, arch=args.arch, d_model=args.d_model, n_layer=args.n_layer,
        attn_layers=parse_layer_list(args.attn_layers) if args.attn_layers else None,
        vocab_size=args.vocab_size, seed=args.seed, d_state=args.d_state, headdim=args.headdim,
        expand=args.expand, ngroups=args.ngroups, d_intermediate=args.d_intermediate,
        num_heads=args.num_heads, fmt=args.format,
    )
    model = load_model(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"path": str(out), "arch": args.arch, "parameters": n_params,
                      "attn_layer_idx": model.config.attn_layer_idx}))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("init-model", help="write a random checkpoint in mamba_ssm's format")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--arch", choices=["mamba2", "hybrid"], default="mamba2")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--attn-layers", default=None, help="comma-separated attention layer indices (hybrid)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--headdim", type=int, default=16)
    p.add_argument("--expand", type=int, default=2)
    p.add_argument("--ngroups", type=int, default=1)
    p.add_argument("--d-intermediate", type=int, default=0, help="gated MLP width (0: none)")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads (hybrid)")
    p.add_argument("--format", choices=["safetensors", "bin"], default="safetensors")
    p.set_defaults(func=run)
