"""``stree bench drafters`` runs every drafter case on a tiny draft model and writes its JSON record."""

import json

from stree.cli import main


def test_bench_drafters_writes_a_record(model_dirs, tmp_path, capsys):
    out = tmp_path / "drafters.json"
    rc = main(["bench", "drafters", "--draft-model", str(model_dirs["draft"]), "--device", "cpu", "--dtype",
               "float32", "--steps", "2", "--context-len", "80", "--out", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["benchmark"] == "drafters" and record["device"] == "cpu"
    assert len(record["rows"]) == 7
    assert all(r["draft_ms_p50"] > 0 and r["mean_nodes"] >= 1 for r in record["rows"])
    assert "p50 ms" in capsys.readouterr().out
