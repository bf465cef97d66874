"""``stree datastore build|info``: tokenize a corpus into a retrieval datastore, or describe one.

A corpus is a text file (one document), a ``.jsonl`` file (one document per line, from its
``text`` field, else its ``turns``/``question``/``answer`` fields), or a directory whose .py, .md
and .txt files are each one document.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from stree.drafter_service.drafters.retrieval.datastore import Datastore
from stree.verifier.model.hub import model_folder_arg

DIRECTORY_SUFFIXES = (".py", ".md", ".txt")
JSONL_FIELDS = ("turns", "question", "answer")
CHUNK_BYTES = 1 << 18  # a long text file is tokenized in pieces of about this size (at line ends)


def corpus_files(corpus: Path) -> list[Path]:
    """The files a corpus path stands for (a file, or a directory's .py/.md/.txt files, sorted)."""
    if not corpus.exists():
        raise FileNotFoundError(f"corpus {corpus} does not exist")
    if corpus.is_file():
        return [corpus]
    files = sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in DIRECTORY_SUFFIXES)
    if not files:
        raise ValueError(f"corpus directory {corpus} has no {'/'.join(DIRECTORY_SUFFIXES)} files")
    return files


def _jsonl_document(record, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if isinstance(record.get("text"), str):
        return record["text"]
    pieces = []
    for key in JSONL_FIELDS:
        value = record.get(key)
        if isinstance(value, str):
            pieces.append(value)
        elif isinstance(value, list):
            pieces.extend(v for v in value if isinstance(v, str))
    if not pieces:
        raise ValueError(f"{where}: no 'text', 'turns', 'question' or 'answer' text field")
    return "\n".join(pieces)


def _text_chunks(path: Path, bar: tqdm) -> Iterator[str]:
    """A text file's content in pieces of about CHUNK_BYTES, split after a newline."""
    chunk, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            chunk.append(line)
            size += len(line)
            bar.update(len(line))
            if size >= CHUNK_BYTES:
                yield b"".join(chunk).decode("utf-8", errors="replace")
                chunk, size = [], 0
    if chunk:
        yield b"".join(chunk).decode("utf-8", errors="replace")


def tokenized_documents(files: list[Path], tokenizer, bar: tqdm) -> Iterator[list[int]]:
    """Token ids of each document of the corpus (empty documents are skipped)."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    bar.update(len(raw))
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                    text = _jsonl_document(record, f"{path}:{lineno}")
                    ids = tokenizer.encode(text, add_special_tokens=False).ids
                    if ids:
                        yield ids
        else:
            ids: list[int] = []
            for piece in _text_chunks(path, bar):
                ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
            if ids:
                yield ids


def load_tokenizer_file(model_dir: Path):
    """``tokenizer.json`` from a model directory (or the file itself)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json" if model_dir.is_dir() else model_dir
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path} (expected MODEL_DIR/tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: not a valid tokenizers file ({exc})") from exc


def build_command(args) -> int:
    corpus = Path(args.corpus)
    files = corpus_files(corpus)
    tokenizer = load_tokenizer_file(Path(args.tokenizer))
    total = sum(os.path.getsize(p) for p in files)
    started = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=args.quiet) as bar:
        documents = list(tokenized_documents(files, tokenizer, bar))
    tokenized = time.perf_counter()
    meta = {"corpus": str(corpus.resolve()), "tokenizer": str(Path(args.tokenizer).resolve()), "files": len(files)}
    store = Datastore.build(documents, tokenizer.get_vocab_size(), meta=meta)
    out = store.save(args.out)
    done = time.perf_counter()
    size = sum(p.stat().st_size for p in out.iterdir())
    print(
        f"datastore {out}: {store.num_sequences} documents from {len(files)} file(s), "
        f"{len(store) - store.num_sequences} tokens, vocab {store.vocab_size}, {size / 1e6:.2f} MB; "
        f"tokenized in {tokenized - started:.1f}s, suffix array in {done - tokenized:.1f}s"
    )
    return 0


def info_command(args) -> int:
    store = Datastore.load(args.datastore)
    info = store.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        print(f"{key}: {value}")
    return 0


def add_parser(subparsers) -> None:
    """Register ``stree datastore build`` and ``stree datastore info``."""
    parser = subparsers.add_parser("datastore", help="build or inspect a retrieval-drafter datastore")
    actions = parser.add_subparsers(dest="datastore_command", metavar="ACTION")
    actions.required = True

    build = actions.add_parser("build", help="tokenize a corpus and index it with a suffix array")
    build.add_argument("corpus", help="a text file, a .jsonl file, or a directory of .py/.md/.txt files")
    build.add_argument("--tokenizer", required=True, metavar="MODEL_DIR", type=model_folder_arg,
                       help="model directory (or Hub id) holding tokenizer.json, or the tokenizer.json file")
    build.add_argument("--out", required=True, metavar="DS", help="datastore directory to write")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=build_command)

    info = actions.add_parser("info", help="print a datastore's header and statistics")
    info.add_argument("datastore", metavar="DS")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=info_command)
