#!/usr/bin/env bash
# Engine checks + benchmarks on the lent H100 (no network; packages from .whl/, prompts from .data/):
# GPU tests (graph step == eager step, fp32 greedy == plain greedy), then `stree bench e2e` on the trained
# pair (HumanEval + MT-Bench, T=0 and 1) and `stree bench batch` (batch 1/4/16/64; 2.7B shape with the oracle).
# Usage (repo root): bench/engine_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
(python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 || true) | tail -25 > "$out/gpu-tests-$tag.txt"; cat "$out/gpu-tests-$tag.txt"
python3 -m stree.cli bench e2e --prompt-sets humaneval,mt_bench --mt-bench .data/mt_bench.jsonl \
  --methods ${E2E_METHODS:-plain,chain,static,beam,auto} --dtype float32 --num-prompts 8 --max-new-tokens 128 \
  --out "$out/e2e-$tag.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
python3 -m stree.cli bench batch --batch-sizes ${BATCHES:-1,4,16,64} ${BATCH_ARGS:---oracle-shape 2.7b} \
  --out "$out/batch-$tag.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
