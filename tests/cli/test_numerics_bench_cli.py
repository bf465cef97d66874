"""``stree bench numerics``: a smoke run on a tiny shape on the CPU (eager timings), its table and JSON record, and
the check it makes before timing (exact numerics: tree logits equal decode steps; fast: they need not)."""

import argparse
import json

from stree.bench import numerics as bench_numerics
from stree.cli import bench as bench_cli


def test_bench_numerics_tiny_cpu_run_prints_and_records(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="stree")
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "numerics.json"
    args = parser.parse_args(["bench", "numerics", "--device", "cpu", "--shape", "tiny", "--batches", "1", "2",
                              "--nodes", "4", "--prompt-len", "6", "--dtype", "float32", "--out", str(out)])
    assert args.func is bench_numerics.run and args.func(args) == 0
    text = capsys.readouterr().out
    assert "exact: 4-node tree logits == decode-step logits along a root-to-leaf path: True" in text
    record = json.loads(out.read_text())
    assert record["benchmark"] == "numerics" and record["tree_logits_equal_decode_steps"]["exact"] is True
    assert [(r["what"], r["batch"], r["nodes"]) for r in record["rows"]] == [
        ("decode_step", 1, 1), ("verify_step", 1, 4), ("decode_step", 2, 1), ("verify_step", 2, 4)]
    assert all(r["exact_ms"] > 0 and r["fast_ms"] > 0 and r["mamba_ssm_ms"] is None for r in record["rows"])
