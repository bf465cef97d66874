#!/usr/bin/env bash
# Exact numerics on the lent GPU: the exact GPU tests (every op's rows invariant in bf16/fp16; speculative greedy
# equals plain greedy for every drafter, batch and model family), then `stree bench numerics` (the 2.7B-shape
# decode step and 16/32-node verify steps at batch 1/16/64, exact against fast against mamba_ssm with causal-conv1d).
# Then (PARTS=e2e) the issue's record: `stree bench e2e --dtype bfloat16 --temperatures 0` on the demo pair, every
# drafter, every prompt set, OUT_DIR/e2e-exact-bf16-TAG.json (every row should say ==greedy True).
# About 3-4 minutes a part on an H100: PARTS="tests e2e" fits one call (default: tests bench).
# Usage (repo root): [PARTS="tests bench e2e"] bench/numerics_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
parts=" ${PARTS:-tests bench} "
if [[ "$parts" == *" tests "* ]]; then
  (timeout "${GPU_TEST_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
    ${GPU_TEST_PATHS:-tests/gpu/test_exact_ops_gpu.py tests/gpu/test_exact_engine_gpu.py} \
    > "$out/numerics-tests-$tag.txt" 2>&1 || true)
  grep -E "passed|failed|^FAILED|Error" "$out/numerics-tests-$tag.txt" | tail -20
fi
if [[ "$parts" == *" bench "* ]]; then
  python3 -m stree.cli bench numerics ${NUMERICS_ARGS:-} --out "$out/numerics-$tag.json" 2>&1 | grep -v '^\[numerics\]'
fi
if [[ "$parts" == *" e2e "* ]]; then
  python3 -m stree.cli bench e2e --dtype bfloat16 --temperatures 0 --num-prompts 8 --max-new-tokens 128 \
    --prompt-sets humaneval,mt_bench,gsm8k,spec_bench,in_domain --mt-bench .data/mt_bench.jsonl \
    --gsm8k .data/gsm8k.jsonl --spec-bench .data/spec_bench.jsonl \
    --methods plain,chain,static,beam,treeflash,auto,ngram --out "$out/e2e-exact-bf16-$tag.json" 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]$' | tail -40
fi
