"""Pieces the ``stree bench`` commands share: a CUDA sync for host timers, the JSON record's header
and writer, the ``--device``/``--dtype`` flags, and the ``--target``/``--draft`` checkpoint flags of
the commands that run the trained demo pair."""

from __future__ import annotations

import json
import sys
from datetime import date
from pathlib import Path

import torch

from stree.verifier.model.hub import model_folder_arg

DEMO_TARGET = "checkpoints/demo-target"
DEMO_DRAFT = "checkpoints/demo-draft"


def cuda_sync() -> None:
    """Wait for queued GPU work (no-op without CUDA), so host timers measure finished work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def add_device_args(p, dtype: str) -> None:
    """``--device`` (default: CUDA when there is one), ``--dtype`` (bfloat16 or float32, default ``dtype``) and
    ``--numerics``."""
    from stree.kernels import numerics

    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default=dtype)
    p.add_argument("--numerics", choices=list(numerics.CHOICES), default=None,
                   help="exact: speculative output equals plain decoding bit for bit; fast: per-shape timed kernels "
                        "(default: $STREE_NUMERICS, else exact)")


def device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype that ``--device`` and ``--dtype`` name (``--numerics`` takes effect here)."""
    from stree.kernels import numerics

    if getattr(args, "numerics", None):
        numerics.use(args.numerics)
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")), DTYPES[args.dtype]


def kernel_settings() -> dict:
    """The environment switches that change which kernels run, as this process resolves them (a record names
    them, since its ``command`` does not show the environment)."""
    from stree.kernels import backend
    from stree.protocols import settings

    return {**settings.snapshot(),
            "STREE_KERNELS": backend.resolve("cuda") if torch.cuda.is_available() else backend.resolve("cpu")}


def record_meta(benchmark: str, device: torch.device) -> dict:
    """The fields every benchmark record starts with: its name, the date, the device's name, the command and the
    kernel switches it ran with."""
    return {"benchmark": benchmark, "date": date.today().isoformat(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "command": "stree " + " ".join(sys.argv[1:]), "kernel_settings": kernel_settings()}


def save_record(path: str, record: dict) -> None:
    """Write ``record`` as indented JSON to ``path``, creating its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2))


def report(record: dict, out: str | None, header: str, line) -> int:
    """Print ``header`` and ``line(row)`` for every row of ``record``, then write ``record`` to ``out``
    (when given); the command's exit status, 0."""
    print(header)
    for r in record["rows"]:
        print(line(r))
    if out:
        save_record(out, record)
    return 0


def add_pair_args(p) -> None:
    """``--target`` and ``--draft``: checkpoint folders, the trained demo pair by default."""
    p.add_argument("--target", default=DEMO_TARGET, type=model_folder_arg, help="folder or Hub id")
    p.add_argument("--draft", default=DEMO_DRAFT, type=model_folder_arg, help="folder or Hub id")


def tee(path: str):
    """A ``print`` for the GPU probe scripts in ``bench/``: each line to stdout and to ``path`` (flushed, so a
    run cut short by the device's time limit keeps what it measured)."""
    out = open(path, "w")

    def say(line: str) -> None:
        print(line)
        out.write(line + "\n")
        out.flush()

    return say


def demo_pair(device, dtype: torch.dtype = torch.float32):
    """The trained demo pair (``checkpoints/demo-target``, ``checkpoints/demo-draft``) on ``device`` in eval mode: the
    models the GPU probes in ``bench/`` time."""
    from stree.verifier.model.checkpoint import load_model

    return tuple(load_model(f"checkpoints/demo-{name}", device=device, dtype=dtype).eval() for name in ("target", "draft"))


def plain_greedy(model, prompt: list[int], n: int = 48) -> list[int]:
    """``n`` tokens of plain greedy decoding after ``prompt`` (prefill, then one-token steps): what the GPU probes in
    ``bench/`` check an engine's greedy output against before they time it."""
    dev = model.device
    state = model.new_state(1, len(prompt) + n + 8)
    model.prefill(torch.tensor([prompt[:-1]], device=dev), state)
    out, tok = [], prompt[-1]
    for _ in range(n):
        tok = int(model.step(torch.tensor([tok], device=dev), state)[0].argmax())
        out.append(tok)
    return out


def cancel_all(engine) -> None:
    """Cancel every request an engine runs and step it until it is idle (a probe's timed engine, afterwards)."""
    for r in engine.slots:
        if r is not None:
            r.cancel()
    while engine.has_work:
        engine.step()
