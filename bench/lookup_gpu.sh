#!/usr/bin/env bash
# Prompt lookup and retrieval drafted on the device, end to end (one device call): the lookup GPU tests (correctness
# only), then `stree bench e2e` of plain, ngram, retrieval and auto on the trained pair (fp32), with fused trees
# (beam + n-gram trie) beside each part alone (beam, ngram-tree) and goodput over all of them (fusion-auto), on the
# prompt sets whose answers copy their context (code_edit, spec_bench_copy) and on HumanEval and MT-Bench.
# Writes OUT_DIR/gpu-tests-lookup-TAG.txt and OUT_DIR/e2e-lookup-TAG.json (+ .png).
# Both fit one device call (10 min): the tests stop at 150 s, the e2e at 420 s (GPU_TEST_TIMEOUT, E2E_TIMEOUT).
# Usage (repo root): bench/lookup_gpu.sh OUT_DIR [TAG]
#   SETS=...  METHODS=...  E2E_ARGS="--target DIR --draft DIR" (the scale pair)  GPU_TESTS=0 (skip the tests)
set -euo pipefail
source bench/gpu_start.sh "$@"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  (timeout ${GPU_TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
     tests/gpu/test_lookup_gpu.py > "$out/gpu-tests-lookup-$tag.txt" 2>&1 || true)
  tail -c 1500 "$out/gpu-tests-lookup-$tag.txt"
fi
timeout "${E2E_TIMEOUT:-420}" python3 -m stree.cli bench e2e \
  --prompt-sets ${SETS:-code_edit,spec_bench_copy,humaneval,mt_bench} \
  --mt-bench .data/mt_bench.jsonl --spec-bench .data/spec_bench.jsonl \
  --methods ${METHODS:-plain,ngram,retrieval,auto,beam,ngram-tree,fusion-ngram,fusion-auto} \
  --dtype float32 --num-prompts 8 --max-new-tokens 128 --temperatures 0,1 \
  --out "$out/e2e-lookup-$tag.json" ${E2E_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' | tail -80
