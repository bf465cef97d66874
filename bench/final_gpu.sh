#!/usr/bin/env bash
# The recorded GPU run (H100): GPU tests, then e2e (trained pair), the 2.7B oracle at batch 1, engine throughput
# at batch 1/4/16/64 on the trained pair, and the 2.7B/130M model step timings with the floor and mamba_ssm.
# Usage (repo root): bench/final_gpu.sh OUT_DIR TAG
set -uo pipefail
out="${1:?usage: bench/final_gpu.sh OUT_DIR TAG}"; tag="${2:?tag}"
mkdir -p "$out"
source bench/gpu_env.sh
clean() { tr '\r' '\n' | grep -v 'it/s\]$' | grep -v '^WARNING: Target directory'; }
(timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -4) | tee "$out/gpu-tests-$tag.txt"
timeout 150 python3 -m stree.cli bench e2e --prompt-sets humaneval,mt_bench --mt-bench .data/mt_bench.jsonl \
  --methods plain,chain,static,beam,auto --dtype float32 --num-prompts 8 --max-new-tokens 128 \
  --out "$out/e2e-$tag.json" 2>&1 | clean
timeout 90 python3 -m stree.cli bench oracle --taus 4 --tree-sizes 8,16 --out "$out/oracle-$tag.json" 2>&1 | clean
timeout 120 python3 -m stree.cli bench batch --batch-sizes 1,4,16,64 --out "$out/batch-$tag.json" 2>&1 | clean | tail -20
timeout 110 python3 -m stree.cli bench kernels --out "$out/kernels" --parts model --model-shapes 2.7b \
  --batches 1 4 16 64 --quick 2>&1 | clean | tail -30
