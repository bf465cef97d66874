"""``stree init-model``: write a random Mamba2 or hybrid checkpoint (with a tokenizer) that loads back.

Its size flags are ``init_model``'s integer keywords, so names and defaults live in one place.
"""

from __future__ import annotations

import inspect
import json

from stree.verifier.model.checkpoint import init_model, load_model

_INT_KEYWORDS = ("d_model", "n_layer", "vocab_size", "seed", "d_state", "headdim", "expand", "ngroups",
                 "d_intermediate", "num_heads")
"""``init_model``'s integer keywords, each a ``--kebab-case`` flag with the function's own default."""
_HELP = {"d_intermediate": "gated MLP width (0: none)", "num_heads": "attention heads (hybrid)"}


def parse_layer_list(text: str, flag: str = "--attn-layers") -> list[int]:
    """Layer indices from ``"3,7"``; a clear error naming ``flag`` otherwise."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} wants comma-separated layer indices, got {text!r}") from None


def run(args) -> int:
    if args.arch == "mamba2" and args.attn_layers:
        raise ValueError("--attn-layers needs --arch hybrid (a mamba2 model has no attention layers)")
    out = init_model(
        args.out_dir, arch=args.arch, attn_layers=parse_layer_list(args.attn_layers) if args.attn_layers else None,
        fmt=args.format, **{name: getattr(args, name) for name in _INT_KEYWORDS},
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
    p.add_argument("--attn-layers", default=None, help="comma-separated attention layer indices (hybrid)")
    defaults = inspect.signature(init_model).parameters
    for name in _INT_KEYWORDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name].default, help=_HELP.get(name))
    p.add_argument("--format", choices=["safetensors", "bin"], default="safetensors")
    p.set_defaults(func=run)
