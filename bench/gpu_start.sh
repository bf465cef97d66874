#!/usr/bin/env bash
# Sourced first, with the script's arguments, by the GPU bench scripts that take OUT_DIR [TAG]: sets
# $out (made if missing) and $tag (default h100-YYYYMMDD), installs through bench/gpu_env.sh, names the GPU, and
# defines gpu_tests (one GPU test file or -k selection on one GPU, time-limited) and gpu_test_files (several files
# one after another).
out="${1:?usage: $0 OUT_DIR [TAG]}"
tag="${2:-h100-$(date +%Y%m%d)}"
mkdir -p "$out"
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpu_tests() {  # gpu_tests GPU SECONDS FILE [K-EXPRESSION]: one test file, or its -k selection, on one GPU,
  # time-limited; its output in OUT/<file>[-<selection>]-TAG.txt and a line (exit code, pytest's summary) in
  # OUT/lanes-TAG.txt
  local name="$(basename "$3" .py)${4:+-$(echo "$4" | tr -c 'a-z0-9\n' '_')}"
  CUDA_VISIBLE_DEVICES=$1 timeout "$2" python3 -m pytest -q -p no:cacheprovider --tb=short -rf --durations=5 \
    "$3" ${4:+-k "$4"} > "$out/$name-$tag.txt" 2>&1
  echo "$name rc=$? $(grep -E '[0-9]+ (passed|failed|error)' "$out/$name-$tag.txt" | tail -1)" >> "$out/lanes-$tag.txt"
}
gpu_test_files() {  # gpu_test_files GPU SECONDS FILE...: each test file in turn (gpu_tests)
  local gpu=$1 secs=$2 f; shift 2
  for f in "$@"; do gpu_tests "$gpu" "$secs" "$f"; done
}
