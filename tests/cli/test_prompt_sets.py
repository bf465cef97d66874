"""The in_domain prompt set: held-out corpus files cut right after a function's signature and docstring."""

from __future__ import annotations

import pytest

from stree.bench.prompt_sets import code_edit_prompt, function_body_prompt, load_prompt_set

SOURCE = '''import os

X = 1


def add(a,
        b: int) -> int:
    """Add two numbers.

    Longer text.
    """
    return a + b


def sub(a, b):
    return a - b
'''


def test_a_function_is_cut_after_its_signature_and_docstring():
    prompt = function_body_prompt(SOURCE)
    assert prompt.endswith('    Longer text.\n    """\n')
    assert "return a + b" not in prompt


def test_without_a_docstring_the_cut_follows_the_signature():
    src = "def f(x):\n    y = x + 1\n    return y\n"
    assert function_body_prompt(src) == "def f(x):\n"
    assert function_body_prompt("X = 1\nprint(X)\n") is None
    assert function_body_prompt("def f():\n") is None  # no body to write


def test_in_domain_set_reads_held_out_files_of_the_corpus(tmp_path):
    pkg = tmp_path / "torch"
    pkg.mkdir()
    for i in range(6):
        (pkg / f"m{i}.py").write_text(f"# module {i}\n" + "# padding line\n" * 20 + SOURCE.replace("add", f"add{i}"))
    prompts = load_prompt_set("in_domain", 0, path=str(tmp_path))
    assert prompts and all(pid.startswith("in_domain/") for pid, _ in prompts)
    for _, text in prompts:
        assert text.endswith('"""\n') and "return a + b" not in text


def test_in_domain_without_functions_is_a_clear_error(tmp_path):
    pkg = tmp_path / "numpy"
    pkg.mkdir()
    for i in range(4):
        (pkg / f"d{i}.py").write_text(f"X = {i}\n" * 60)  # distinct files: the corpus drops duplicates
    with pytest.raises(ValueError, match="no held-out corpus file has a function"):
        load_prompt_set("in_domain", 0, path=str(tmp_path))


def test_code_edit_prompt_restates_a_function_for_its_rewrite():
    src = "import os\n\n\nclass A:\n    @staticmethod\n    def scale(values,\n              k: int = 2):  # note\n" + \
          "".join(f"        v{i} = values[{i}] * k\n" for i in range(5)) + "        return v4\n"
    prompt = code_edit_prompt(src)
    body, _, ask = prompt.partition("\n\n\n# scale, rewritten with type hints:\n")
    assert body.startswith("@staticmethod\ndef scale(values,") and body.endswith("return v4")  # dedented
    assert ask == "@staticmethod\ndef scale(values,\n          k: int = 2):  # note\n"  # its signature again
    assert code_edit_prompt("def f(x): return x\n" * 3) is None  # no body of its own lines
    assert code_edit_prompt("def f(:\n") is None  # not Python


def test_code_edit_and_copy_sets_load(tmp_path):
    pkg = tmp_path / "torch"
    pkg.mkdir()
    for i in range(6):
        (pkg / f"m{i}.py").write_text(f"# module {i}\n" + "# padding line\n" * 20 + SOURCE.replace(
            "    return a + b\n", "".join(f"    c{k} = a + {k}\n" for k in range(6)) + "    return a + b\n"))
    prompts = load_prompt_set("code_edit", 0, path=str(tmp_path))
    assert prompts and all(pid.startswith("code_edit/") and "rewritten" in text for pid, text in prompts)
    spec = tmp_path / "spec.jsonl"
    spec.write_text('{"category": "summarization", "turns": ["Summarize: a b"]}\n{"category": "qa", "turns": ["q"]}\n'
                    '{"category": "rag", "turns": ["Passage: x. Question?"]}\n')
    assert [t for _, t in load_prompt_set("spec_bench_copy", 0, str(spec))] == ["Summarize: a b",
                                                                                 "Passage: x. Question?"]
    spec.write_text('{"category": "qa", "turns": ["q"]}\n')
    with pytest.raises(ValueError, match="no record of the categories summarization, rag"):
        load_prompt_set("spec_bench_copy", 0, str(spec))
