"""An offline text corpus: Python sources and docs of installed packages, split into train and validation.

No download: the files come from the running interpreter's site-packages (or any folders given).
File order is deterministic (a hash of each file's path relative to its root), so the same
packages give the same corpus; a byte cap keeps it small and every package contributes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

DEFAULT_PACKAGES = ("torch", "numpy", "scipy", "setuptools", "pip", "matplotlib", "triton", "tqdm")
SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MIN_FILE_BYTES = 200
MAX_FILE_BYTES = 200_000  # bigger files are mostly generated tables


@dataclass
class Corpus:
    """Documents (one per file) of the train and validation splits, and where they came from."""

    train: list[str]
    val: list[str]
    meta: dict = field(default_factory=dict)

    def write_jsonl(self, path: str | os.PathLike, split: str = "train") -> Path:
        """One ``{"text": ...}`` line per document (the format ``stree datastore build`` reads)."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for doc in getattr(self, split):
                f.write(json.dumps({"text": doc}) + "\n")
        return out


def site_packages() -> list[Path]:
    """The running interpreter's site-packages folders (pure and platform), existing ones only."""
    paths = sysconfig.get_paths()
    seen: list[Path] = []
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p not in seen:
            seen.append(p)
    return seen


def _file_key(rel: str, salt: str) -> bytes:
    return hashlib.sha1((salt + rel).encode()).digest()


def package_files(packages: Sequence[str], roots: Iterable[Path]) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every text file of the named packages under ``roots``."""
    roots = [Path(r) for r in roots]
    found: dict[str, Path] = {}
    missing = []
    for pkg in packages:
        hit = False
        for root in roots:
            base = root / pkg
            if base.is_dir():
                hit = True
                for p in base.rglob("*"):
                    if p.suffix in SUFFIXES and p.is_file():
                        found.setdefault(str(p.relative_to(root)), p)
            elif (root / f"{pkg}.py").is_file():
                hit = True
                found.setdefault(f"{pkg}.py", root / f"{pkg}.py")
        if not hit:
            missing.append(pkg)
    if len(missing) == len(packages):
        raise ValueError(f"none of the packages {list(packages)} is installed under {[str(r) for r in roots]}")
    return sorted(found.items())


def _read_text(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        if not MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def build_corpus(
    packages: Sequence[str] = DEFAULT_PACKAGES,
    max_bytes: int = 24_000_000,
    val_fraction: float = 0.02,
    roots: Iterable[Path] | None = None,
    seed: int = 0,
) -> Corpus:
    """Read up to ``max_bytes`` of text files of ``packages``; about ``val_fraction`` of them are held out."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    roots = list(roots) if roots is not None else site_packages()
    files = package_files(packages, roots)
    salt = f"stree-corpus-{seed}:"
    files.sort(key=lambda item: _file_key(item[0], salt))  # deterministic interleaving of packages
    train, val, used, total = [], [], [], 0
    for rel, path in files:
        if total >= max_bytes:
            break
        text = _read_text(path)
        if text is None:
            continue
        is_val = _file_key(rel, "val:" + salt)[0] < 256 * val_fraction
        (val if is_val else train).append(text)
        used.append(rel)
        total += len(text.encode("utf-8"))
    if not val and len(train) > 1:  # a small corpus may draw no validation file: hold out the last one
        val.append(train.pop())
    if not train or not val:
        raise ValueError(f"corpus too small: {len(train)} train and {len(val)} validation files "
                         f"from {len(files)} candidates (need at least one of each)")
    meta = {"packages": list(packages), "roots": [str(r) for r in roots], "files": len(used),
            "train_files": len(train), "val_files": len(val), "bytes": total, "max_bytes": max_bytes,
            "val_fraction": val_fraction, "seed": seed}
    return Corpus(train, val, meta)


def tokenize(tokenizer, docs: Sequence[str], eos_id: int | None) -> np.ndarray:
    """All documents' token ids concatenated (``eos_id`` after each when given), as int32."""
    parts = []
    for enc in tokenizer.encode_batch(list(docs), add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        if eos_id is not None:
            parts.append(np.asarray([eos_id], dtype=np.int32))
    if not parts:
        raise ValueError("tokenize: no documents")
    return np.concatenate(parts)
