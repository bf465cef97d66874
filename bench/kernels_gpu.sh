#!/usr/bin/env bash
# Kernel checks + timings on a GPU box without network (the lent H100): mamba_ssm's Triton kernels come
# from its sdist in .whl/ (see DESIGN.md section 4), then `stree bench kernels` runs from the checkout.
# Usage (repo root): bench/kernels_gpu.sh OUT_DIR [extra `stree bench kernels` options]
set -euo pipefail
out="${1:?usage: bench/kernels_gpu.sh OUT_DIR [options]}"
shift
sdist=$(ls .whl/mamba_ssm-*.tar.gz 2>/dev/null | head -n1 || true)
if [ -n "$sdist" ]; then
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation \
    --no-index --target /tmp/stree-site "$sdist"
  export PYTHONPATH=/tmp/stree-site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/mamba_ssm-*.tar.gz: running without the mamba_ssm baselines" >&2
fi
PYTHONUNBUFFERED=1 python3 -m stree.kernels.bench_kernels kernels --out "$out" "$@"
