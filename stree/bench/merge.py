"""``stree bench merge``: one record from several of the same benchmark (runs split over GPUs or calls).

The first record's header is kept, every record's rows are concatenated in order, and ``commands`` lists each
record's command, so one ``results/`` file answers what several lanes measured (e.g. ``e2e-scale-<card>-<date>.json``
from one e2e run per prompt set). Records of different benchmarks or from different devices are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from stree.bench.common import save_record


def merge_records(records: list[dict]) -> dict:
    """The merged record of ``records`` (each with ``benchmark``, ``device`` and ``rows``)."""
    if not records:
        raise ValueError("nothing to merge")
    for key in ("benchmark", "device"):
        values = {r.get(key) for r in records}
        if len(values) > 1:
            raise ValueError(f"records disagree on {key}: {sorted(map(str, values))}")
    if any(not isinstance(r.get("rows"), list) for r in records):
        raise ValueError("every record needs a list of rows")
    head = {k: v for k, v in records[0].items() if k not in ("rows", "command")}
    return {**head, "commands": [r.get("command") for r in records],
            "complete": all(r.get("complete", True) for r in records), "rows": [x for r in records for x in r["rows"]]}


def run(args) -> int:
    records = []
    for path in args.records:
        try:
            records.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable JSON record ({exc})") from exc
    merged = merge_records(records)
    save_record(args.out, merged)
    print(f"wrote {args.out}: {len(merged['rows'])} rows from {len(records)} records")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("merge", help="one record from several of the same benchmark (rows concatenated)")
    p.add_argument("out", help="the merged record's path")
    p.add_argument("records", nargs="+", help="records of one benchmark, in the order their rows go")
    p.set_defaults(func=run)
