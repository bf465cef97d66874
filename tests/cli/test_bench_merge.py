"""``stree bench merge``: rows of records of one benchmark concatenated under the first header; mixed benchmarks,
devices or unreadable files refused with a clear message."""

from __future__ import annotations

import json

import pytest

from stree.cli import main


def _record(path, benchmark="e2e", device="NVIDIA H100", rows=(), command="stree bench e2e"):
    path.write_text(json.dumps({"benchmark": benchmark, "device": device, "command": command, "dtype": "bfloat16",
                                "rows": list(rows)}))
    return str(path)


def test_merge_concatenates_rows_in_order_and_lists_the_commands(tmp_path):
    a = _record(tmp_path / "a.json", rows=[{"prompt_set": "humaneval"}], command="stree bench e2e --prompt-sets humaneval")
    b = _record(tmp_path / "b.json", rows=[{"prompt_set": "mt_bench"}, {"prompt_set": "mt_bench", "t": 1}],
                command="stree bench e2e --prompt-sets mt_bench")
    out = tmp_path / "merged" / "e2e-scale.json"
    assert main(["bench", "merge", str(out), a, b]) == 0
    merged = json.loads(out.read_text())
    assert [r["prompt_set"] for r in merged["rows"]] == ["humaneval", "mt_bench", "mt_bench"]
    assert merged["commands"] == ["stree bench e2e --prompt-sets humaneval", "stree bench e2e --prompt-sets mt_bench"]
    assert merged["benchmark"] == "e2e" and merged["dtype"] == "bfloat16" and merged["complete"] is True


@pytest.mark.parametrize("other, what", [(dict(benchmark="batch"), "benchmark"), (dict(device="NVIDIA H200"), "device")])
def test_merge_refuses_records_that_disagree(tmp_path, capsys, other, what):
    a = _record(tmp_path / "a.json")
    b = _record(tmp_path / "b.json", **other)
    assert main(["bench", "merge", str(tmp_path / "m.json"), a, b]) != 0
    assert f"disagree on {what}" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_merge_names_an_unreadable_record(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "merge", str(tmp_path / "m.json"), _record(tmp_path / "a.json"), str(bad)]) != 0
    assert "bad.json: not a readable JSON record" in capsys.readouterr().err
