#!/usr/bin/env bash
# Sourced first, with the script's arguments, by the GPU bench scripts that take OUT_DIR [TAG]: sets
# $out (made if missing) and $tag (default h100-YYYYMMDD), installs through bench/gpu_env.sh, names the GPU, and
# defines gpu_test_files (GPU test files run one after another on one GPU, each time-limited).
out="${1:?usage: $0 OUT_DIR [TAG]}"
tag="${2:-h100-$(date +%Y%m%d)}"
mkdir -p "$out"
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpu_test_files() {  # gpu_test_files GPU SECONDS FILE...: each test file on one GPU, time-limited; its output in
  # OUT/<file>-TAG.txt and a line each (exit code, pytest's summary) in OUT/lanes-TAG.txt
  local gpu=$1 secs=$2 f name; shift 2
  for f in "$@"; do
    name=$(basename "$f" .py)
    CUDA_VISIBLE_DEVICES=$gpu timeout "$secs" python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
      --durations=5 "$f" > "$out/$name-$tag.txt" 2>&1
    echo "$name rc=$? $(grep -E '[0-9]+ (passed|failed|error)' "$out/$name-$tag.txt" | tail -1)" >> "$out/lanes-$tag.txt"
  done
}
