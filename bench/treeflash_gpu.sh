#!/usr/bin/env bash
# One device call: distil the TreeFlash drafter from the demo target (stree train drafter --kind treeflash)
# into OUT_DIR/ckpt/demo-treeflash (TRAIN=0: use checkpoints/demo-treeflash), with the GPU tests running
# beside it (correctness only, no timing);
# then (STEP_PROFILE=1) the step profile, and unless E2E=0 the e2e comparison of every device method,
# TreeFlash and its marginal ablation included (fp32). At most 8 files land in OUT_DIR (the device tool's limit).
# Usage (repo root): bench/treeflash_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
if [ "${GPU_TESTS:-1}" = 1 ]; then
  (timeout ${GPU_TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider --tb=short -rf ${GPU_TEST_PATHS:-tests/gpu} \
     > "$out/gpu-tests-$tag.txt" 2>&1 || true) &
  tests_pid=$!
fi
treeflash=checkpoints/demo-treeflash  # the committed one, unless TRAIN=1 distils a new one here
if [ "${TRAIN:-1}" = 1 ]; then
  python3 -m stree.cli train drafter --kind treeflash --target checkpoints/demo-target \
    --out "$out/ckpt/demo-treeflash" \
    --steps ${TF_STEPS:-3000} --batch-size 32 --seq-len 256 --minutes ${TF_MINUTES:-10} --corpus-bytes 4000000 \
    --device cuda 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]$' | tail -8
  treeflash="$out/ckpt/demo-treeflash"
fi
if [ -n "${tests_pid:-}" ]; then wait "$tests_pid"; tail -c 2000 "$out/gpu-tests-$tag.txt"; fi
if [ "${STEP_PROFILE:-0}" = 1 ]; then
  python3 -m stree.cli bench step-profile --dtype float32 --out "$out/step-profile-$tag.json" > "$out/step-profile-$tag.txt" 2>&1
  grep -A4 '"graph_ms"' "$out/step-profile-$tag.txt"; grep -A7 '"components_ms"' "$out/step-profile-$tag.txt" | tail -6
  grep "^== linear" "$out/step-profile-$tag.txt" | cut -c1-300; rm "$out/step-profile-$tag.txt"
fi
if [ "${E2E:-1}" = 1 ]; then
  python3 -m stree.cli bench e2e --prompt-sets ${SETS:-humaneval,mt_bench,in_domain} --mt-bench .data/mt_bench.jsonl \
    --methods ${E2E_METHODS:-plain,chain,static,beam,auto,treeflash,treeflash-marginal} --treeflash "$treeflash" \
    --dtype float32 --num-prompts 8 --max-new-tokens 128 --out "$out/e2e-fp32-$tag.json" 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]$' | tail -40
fi
