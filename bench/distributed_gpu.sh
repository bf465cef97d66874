#!/usr/bin/env bash
# The distributed deployment on a 2- or 4-GPU machine (carry .whl-ray/ beside .whl/ and .data/: Ray and what it
# needs, bench/repack_ray_wheel.py): `stree bench distributed` runs the demo drafter as a Ray actor on the last
# GPU for the demo target on GPU 0 (greedy equality, ms per step against the in-process drafter, and drafting 4
# trees ahead while the target verifies: overlap_vs_sequential), then the
# OpenAI app on Ray Serve with 1, 2 (and 4) verifier replicas under `stree bench serve`'s load at concurrency 64.
# PAIR=DIR runs a trained pair instead of the demo pair (DIR/scale-target and DIR/scale-draft, bench/scale_pair_gpu.sh's
# layout; default: the scale pair headline_gpu.sh left on this machine, if any), in DTYPE (default bf16).
# Record: OUT/distributed-<card>-<date>.json (copy it to results/). Usage (repo root): bench/distributed_gpu.sh OUT [TAG]
set -uo pipefail
source bench/gpu_start.sh "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import ray; print('ray', ray.__version__)" || { echo "Ray is not installed: carry .whl-ray/"; exit 2; }
n=$(nvidia-smi -L | wc -l)
replicas=$([ "$n" -ge 4 ] && echo 1,2,4 || echo 1,2)
pair=${PAIR:-/tmp/stree-lease/scale/pair}
models=()
[ -f "$pair/scale-target/config.json" ] && models=(--target "$pair/scale-target" --draft "$pair/scale-draft")
echo "pair: ${models[*]:-the demo pair}"
data=$(pwd)/.data out=$(cd "$out" && pwd)
cd "$(mktemp -d)"  # Ray's workers put the driver's folder first on sys.path: the checkout's stree/ would shadow
timeout "${DIST_S:-540}" python3 -m stree.cli bench distributed "${models[@]}" --dtype "${DTYPE:-bfloat16}" --prompt-set mt_bench \
  --prompt-file "$data/mt_bench.jsonl" --num-prompts 256 --remote-prompts 8 --replicas "$replicas" \
  --concurrency 64 --out "$out" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' | tail -n 20
tail -n 5 "$out"/distributed-logs/*.log 2>/dev/null | cut -c1-200 | tail -n 20
