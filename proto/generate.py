"""Regenerate the checked-in Python stubs of ``stree/v1/*.proto`` with grpcio-tools.

Run ``python proto/generate.py`` after editing a .proto. protoc names imports after the proto
path (``from stree.v1 import ...``); the installed package is ``stree.proto.stree.v1``, so those
imports are rewritten. ``tests/test_proto.py`` regenerates into a temp dir and compares.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "stree" / "v1"
IMPORT_PREFIX = "stree.proto.stree.v1"
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.proto"))


def _fix_imports(text: str) -> str:
    # "from stree.v1 import common_pb2 as ..." -> "from stree.proto.stree.v1 import common_pb2 as ..."
    return re.sub(r"^(\s*)from stree\.v1 import ", rf"\1from {IMPORT_PREFIX} import ", text, flags=re.M)


def generate(out_root: Path) -> list[Path]:
    """Write stubs for every proto under ``out_root/stree/v1``; returns the written paths."""
    from grpc_tools import protoc
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    rels = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    if not rels:
        raise ValueError(f"no .proto files under {PACKAGE_DIR}")
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *rels,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    written = []
    for path in sorted((out_root / "stree" / "v1").iterdir()):
        if path.name.endswith(_GENERATED_SUFFIXES):
            path.write_text(_fix_imports(path.read_text()))
            written.append(path)
    return written


def stale_files() -> list[str]:
    """Names of checked-in stubs that differ from a fresh generation (or are missing/extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    current = {
        p.name: p.read_text() for p in PACKAGE_DIR.iterdir() if p.name.endswith(_GENERATED_SUFFIXES)
    }
    return sorted(n for n in set(fresh) | set(current) if fresh.get(n) != current.get(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in stubs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs: " + ", ".join(stale), file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    for path in generate(PROTO_ROOT):
        print(f"wrote {path.relative_to(PROTO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
