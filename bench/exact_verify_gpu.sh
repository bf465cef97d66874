#!/usr/bin/env bash
# The exact engine GPU tests split over the 2-GPU machine (nvidia-h100-x2), each selection time-limited, with the
# CUDA-graph counter test and bench/exact_probe.py: about 7 minutes. Usage (repo root): bench/exact_verify_gpu.sh OUT_DIR [TAG]
set -uo pipefail
source bench/gpu_start.sh "$@"
tests() {  # tests GPU SECONDS FILE K-EXPRESSION: one selection, its verdict in lanes-TAG.txt
  local name="$(basename "$3" .py)-$(echo "$4" | tr -c 'a-z0-9\n' '_')"
  CUDA_VISIBLE_DEVICES=$1 timeout "$2" python3 -m pytest -q -p no:cacheprovider --tb=short -rf "$3" -k "$4" \
    > "$out/$name-$tag.txt" 2>&1
  echo "$3 -k '$4' rc=$? $(grep -E '[0-9]+ (passed|failed|error)' "$out/$name-$tag.txt" | tail -1)" >> "$out/lanes-$tag.txt"
}
engine=tests/gpu/test_exact_engine_gpu.py
(tests 0 40 tests/gpu/test_cuda_graph_counters_gpu.py ""
 CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/exact_probe.py > "$out/exact-probe-$tag.txt" 2>&1
 tests 0 190 $engine "every_drafter and dtype0"
 tests 0 70 $engine "request_alone") &
(tests 1 130 $engine "every_drafter and dtype1"
 tests 1 130 $engine "every_drafter and dtype2"
 tests 1 100 $engine "2p7b_shape_every"
 tests 1 60 $engine "hf_family and dtype0") &
wait
echo "===== exact verify summary ($tag)"
cat "$out/lanes-$tag.txt"
grep -hE "^FAILED|^E  " "$out"/test_*-"$tag".txt | head -24 | cut -c1-300
grep -E "exact-probe|Error" "$out/exact-probe-$tag.txt" | cut -c1-300
