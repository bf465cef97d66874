#!/usr/bin/env bash
# Sourced first, with the script's arguments, by the GPU bench scripts that take OUT_DIR [TAG]: sets
# $out (made if missing) and $tag (default h100-YYYYMMDD), installs through bench/gpu_env.sh, names the GPU.
out="${1:?usage: $0 OUT_DIR [TAG]}"
tag="${2:-h100-$(date +%Y%m%d)}"
mkdir -p "$out"
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
