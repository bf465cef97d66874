#!/usr/bin/env bash
# End-to-end and oracle benchmarks on a GPU box without network (the lent H100): packages come from
# .whl/ (bench/gpu_env.sh), prompt files from .data/ (copies of ../shared/data, not in git), the
# trained pair from checkpoints/.
# Usage (repo root): bench/e2e_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
python3 -m stree.cli bench oracle --out "$out/oracle-$tag.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
timeout "${E2E_TIMEOUT:-420}" python3 -m stree.cli bench e2e --mt-bench .data/mt_bench.jsonl --gsm8k .data/gsm8k.jsonl \
  --spec-bench .data/spec_bench.jsonl --out "$out/e2e-$tag.json" ${E2E_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
