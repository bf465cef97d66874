"""``stree bench distributed`` on the CPU: the drafter service on a local Ray, the demo pair decoded plainly, with
the drafter in process, through the service and drafting ahead (all equal to plain greedy), then one Ray Serve
replica loaded by one client at a concurrency above the per-client stream limit (none refused: the bench lifts it
for its one-client load). The record carries the keys the distributed issue names."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray.serve")

from stree.cli import main  # noqa: E402


@pytest.mark.slow
def test_distributed_bench_record_on_the_cpu(tmp_path):
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"Tell me about item {i}."]})
                                 for i in range(5)) + "\n")
    assert main(["bench", "distributed", "--prompt-set", "mt_bench", "--prompt-file", str(prompts),
                 "--num-prompts", "20", "--remote-prompts", "1", "--max-new-tokens", "6", "--replicas", "1",
                 "--concurrency", "20", "--out", str(tmp_path)]) == 0
    (record,) = tmp_path.glob("distributed-cpu-*.json")
    rec = json.loads(record.read_text())
    assert {"overlap_vs_sequential", "replica_scaling", "remote_step_overhead_ms"} <= set(rec)
    assert rec["replica_scaling"] == {"1": 1.0}
    assert [r["path"] for r in rec["remote_rows"]] == ["plain", "in-process", "remote", "remote+ahead"]
    assert all(r["equals_plain_greedy"] for r in rec["remote_rows"])
    remote = rec["remote_rows"][2]  # where the remote step's wait went: the replica's drafting is part of it
    assert 0 < remote["replica_draft_ms_per_tree"] < remote["wait_ms_per_tree"]
    (row,) = rec["serve_rows"]
    assert (row["completed"], row["failed"]) == (20, 0)  # 20 streams of one client, above the default 16
