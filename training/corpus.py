"""An offline text corpus: Python sources and docs of installed packages, split into train and validation.

No download: the files come from the running interpreter's site-packages (or any folders given): the named
packages, or with ``packages=("all",)`` every package there plus the standard library. File order is
deterministic (a hash of each file's path relative to its root), so the same packages give the same corpus, and
a file is held out for validation by a hash of that path alone (so a file held out of a small corpus is held out
of a bigger one too). Files that cannot be read as UTF-8, look binary (NUL or many control characters), or are
tiny or huge are skipped; a file whose text equals an earlier file's (by content hash) is dropped. A byte cap
keeps the corpus to size; every package contributes.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

DEFAULT_PACKAGES = ("torch", "numpy", "scipy", "setuptools", "pip", "matplotlib", "triton", "tqdm")
ALL_PACKAGES = "all"  # every installed package and the standard library
SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MIN_FILE_BYTES = 200
MAX_FILE_BYTES = 200_000  # bigger files are mostly generated tables
MAX_CONTROL_FRACTION = 0.01  # more control characters than this (besides tab, newline, CR, form feed): binary
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", "node_modules"}


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


@dataclass(frozen=True)
class SourceFile:
    """One candidate file: its path relative to its root (what orders and splits the corpus), size, split."""

    rel: str
    path: str
    size: int
    val: bool


def site_packages() -> list[Path]:
    """The running interpreter's package folders: sysconfig's purelib/platlib, ``site``'s folders and any
    site-packages/dist-packages folder on ``sys.path`` (existing ones, each once)."""
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"]]
    try:
        candidates += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # some virtualenv site modules lack these
        pass
    candidates += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    seen: list[Path] = []
    for c in candidates:
        p = Path(c)
        if p.is_dir() and p.resolve() not in [s.resolve() for s in seen]:
            seen.append(p)
    return seen


def default_roots(packages: Sequence[str]) -> list[Path]:
    """``site_packages()``, and the standard library too when ``packages`` is ``("all",)``."""
    roots = site_packages()
    if list(packages) == [ALL_PACKAGES]:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        if stdlib.is_dir() and stdlib.resolve() not in [r.resolve() for r in roots]:
            roots.append(stdlib)
    return roots


def _file_key(rel: str, salt: str) -> bytes:
    return hashlib.sha1((salt + rel).encode()).digest()


def _walk(base: Path):
    """Files under ``base``, not descending into caches, VCS folders or nested package roots."""
    for dirpath, dirnames, filenames in os.walk(base, onerror=lambda exc: None):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(SUFFIXES):
                yield Path(dirpath) / name


def package_files(packages: Sequence[str], roots: Iterable[Path]) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every text file of the named packages (or of everything, ``("all",)``)
    under ``roots``; the first root holding a relative path wins."""
    roots = [Path(r) for r in roots]
    found: dict[str, Path] = {}
    if list(packages) == [ALL_PACKAGES]:
        for root in roots:
            for p in _walk(root):
                found.setdefault(str(p.relative_to(root)), p)
        if not found:
            raise ValueError(f"no text files under {[str(r) for r in roots]}")
        return sorted(found.items())
    missing = []
    for pkg in packages:
        hit = False
        for root in roots:
            base = root / pkg
            if base.is_dir():
                hit = True
                for p in _walk(base):
                    found.setdefault(str(p.relative_to(root)), p)
            elif (root / f"{pkg}.py").is_file():
                hit = True
                found.setdefault(f"{pkg}.py", root / f"{pkg}.py")
        if not hit:
            missing.append(pkg)
    if len(missing) == len(packages):
        raise ValueError(f"none of the packages {list(packages)} is installed under {[str(r) for r in roots]}")
    return sorted(found.items())


def list_files(packages: Sequence[str] = DEFAULT_PACKAGES, roots: Iterable[Path] | None = None, seed: int = 0,
               val_fraction: float = 0.02, max_file_bytes: int = MAX_FILE_BYTES) -> list[SourceFile]:
    """The corpus's candidate files in corpus order, each marked train or validation; sizes outside
    ``MIN_FILE_BYTES..max_file_bytes`` (and files that cannot be stat'ed) are left out."""
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    roots = list(roots) if roots is not None else default_roots(packages)
    salt = f"stree-corpus-{seed}:"
    out = []
    for rel, path in package_files(packages, roots):
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if MIN_FILE_BYTES <= size <= max_file_bytes:
            out.append(SourceFile(rel, str(path), size, _file_key(rel, "val:" + salt)[0] < 256 * val_fraction))
    out.sort(key=lambda f: _file_key(f.rel, salt))  # deterministic interleaving of packages
    return out


def read_text(path: str | os.PathLike) -> str | None:
    """The file's text, or None where it cannot be read, is not UTF-8, or looks binary."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    control = sum(1 for ch in text if ord(ch) < 32 and ch not in "\t\n\r\f")
    if control > MAX_CONTROL_FRACTION * max(1, len(text)):
        return None
    return text


def content_key(text: str) -> bytes:
    """What duplicates share: a hash of the text."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class DocumentFilter:
    """Keeps the first file of each text, up to a byte cap: ``keep(key, nbytes)`` in corpus order."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes, self.total, self.duplicates = max_bytes, 0, 0
        self.seen: set[bytes] = set()

    @property
    def full(self) -> bool:
        return self.total >= self.max_bytes

    def keep(self, key: bytes, nbytes: int) -> bool:
        if key in self.seen:
            self.duplicates += 1
            return False
        self.seen.add(key)
        self.total += nbytes
        return True


def iter_documents(files: Sequence[SourceFile], max_bytes: int):
    """``(file, text)`` of the readable, first-of-their-text files in corpus order, until ``max_bytes`` of text."""
    keep = DocumentFilter(max_bytes)
    for f in files:
        if keep.full:
            return
        text = read_text(f.path)
        if text is not None and keep.keep(content_key(text), len(text.encode("utf-8"))):
            yield f, text


def split_check(train: int, val: int, candidates: int) -> None:
    if not train or not val:
        raise ValueError(f"corpus too small: {train} train and {val} validation files "
                         f"from {candidates} candidates (need at least one of each)")


def build_corpus(
    packages: Sequence[str] = DEFAULT_PACKAGES,
    max_bytes: int = 24_000_000,
    val_fraction: float = 0.02,
    roots: Iterable[Path] | None = None,
    seed: int = 0,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> Corpus:
    """Read up to ``max_bytes`` of text files of ``packages``; about ``val_fraction`` of them are held out."""
    roots = list(roots) if roots is not None else default_roots(packages)
    files = list_files(packages, roots, seed, val_fraction, max_file_bytes)
    train, val, total = [], [], 0
    for f, text in iter_documents(files, max_bytes):
        (val if f.val else train).append(text)
        total += len(text.encode("utf-8"))
    if not val and len(train) > 1:  # a small corpus may draw no validation file: hold out the last one
        val.append(train.pop())
    split_check(len(train), len(val), len(files))
    meta = {"packages": list(packages), "roots": [str(r) for r in roots], "files": len(train) + len(val),
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
