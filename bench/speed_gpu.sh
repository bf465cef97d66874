#!/usr/bin/env bash
# One device call: GPU tests (summary and failures to OUT), the step profile, then the trained-pair e2e
# benchmark (HumanEval + MT-Bench, 8 prompts x 128 tokens) in each of $DTYPES (default float32).
# Usage (repo root): bench/speed_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  (timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -rf ${GPU_TEST_PATHS:-tests/gpu} > "$out/gpu-tests-$tag.txt" 2>&1 || true)
  grep -E "passed|failed|^FAILED|Error" "$out/gpu-tests-$tag.txt" | tail -15
fi
python3 -m stree.cli bench step-profile --shapes ${SHAPES:-none chain:4 beam:5x3} --dtype float32 \
  --out "$out/step-profile-$tag.json" > "$out/step-profile-$tag.txt" 2>&1
grep -A4 "^== target_tree_pass_5\|^== target_step\|^== draft_tree" "$out/step-profile-$tag.txt"; grep "^== linear" "$out/step-profile-$tag.txt"
grep -A5 '"graph_ms"' "$out/step-profile-$tag.txt"
grep -A7 '"components_ms"' "$out/step-profile-$tag.txt"
for dtype in ${DTYPES:-float32}; do
  python3 -m stree.cli bench e2e --prompt-sets ${SETS:-humaneval,mt_bench,in_domain} --mt-bench .data/mt_bench.jsonl \
    --methods ${E2E_METHODS:-plain,chain,static,beam,auto} --dtype $dtype --num-prompts 8 --max-new-tokens 128 \
    --out "$out/e2e-$dtype-$tag.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' | tail -22
done
