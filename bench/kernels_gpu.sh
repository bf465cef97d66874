#!/usr/bin/env bash
# Kernel checks + timings on a GPU box without network (the lent H100): packages come from .whl/
# (bench/gpu_env.sh), then `stree bench kernels` runs.
# Usage (repo root): bench/kernels_gpu.sh OUT_DIR [extra `stree bench kernels` options]
set -euo pipefail
out="${1:?usage: bench/kernels_gpu.sh OUT_DIR [options]}"
shift
source bench/gpu_env.sh
python3 -m stree.cli bench kernels --out "$out" "$@"
