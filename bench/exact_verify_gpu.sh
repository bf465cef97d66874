#!/usr/bin/env bash
# The exact engine GPU tests split over the 2-GPU machine (nvidia-h100-x2), each selection time-limited, with the
# CUDA-graph counter test and bench/exact_probe.py. Default: about 7 minutes. LANE0 / LANE1 (pytest -k expressions
# separated by ';') and SEL_S (seconds per selection) choose other selections, e.g. what an earlier run left
# unfinished: LANE0="every_drafter and hybrid and dtype1" LANE1="hf_family" SEL_S=280 (no probe then: PROBE=0).
# Usage (repo root): bench/exact_verify_gpu.sh OUT_DIR [TAG]
set -uo pipefail
source bench/gpu_start.sh "$@"
lane() {  # lane GPU SELECTIONS: the selections one after another on one GPU
  local gpu=$1 sel
  IFS=';' read -ra sels <<< "$2"
  for sel in "${sels[@]}"; do gpu_tests "$gpu" "${SEL_S:-130}" tests/gpu/test_exact_engine_gpu.py "$sel"; done
}
(if [ "${PROBE:-1}" = 1 ]; then
   gpu_tests 0 40 tests/gpu/test_cuda_graph_counters_gpu.py
   CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/exact_probe.py > "$out/exact-probe-$tag.txt" 2>&1
 fi
 lane 0 "${LANE0:-every_drafter and dtype0;request_alone}") &
lane 1 "${LANE1:-every_drafter and dtype1;every_drafter and dtype2;2p7b_shape_every;hf_family and dtype0}" &
wait
echo "===== exact verify summary ($tag)"
cat "$out/lanes-$tag.txt"
grep -hE "^FAILED|^E  " "$out"/test_*-"$tag".txt | head -24 | cut -c1-300
grep -E "exact-probe|Error" "$out/exact-probe-$tag.txt" 2>/dev/null | cut -c1-300
