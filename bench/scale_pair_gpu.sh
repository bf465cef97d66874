#!/usr/bin/env bash
# Train the benchmark pair at scale on this GPU machine, data-parallel over every GPU (`stree bench scale-pair`):
# a 48-layer, d_model-1024 hybrid target of about 315M parameters (attention at layers 16 and 32), its 2-layer
# d_model-512 Mamba2 drafter and a TreeFlash head, on every installed package's sources, seeded. About 10 minutes
# on the 4-GPU H100 machine (the target phase is capped at 5.5 min, the drafters at 1.5 and 1 min); 1 or 2 GPUs
# train as long on fewer tokens.
# Meant to be started detached and polled:
#   setsid nohup bench/scale_pair_gpu.sh out/scale >/dev/null 2>&1 </dev/null &
#   tail -n 3 out/scale/scale-pair.log; cat out/scale/DONE 2>/dev/null   # DONE: the exit code, once it ended
# Writes out/scale/pair/{scale-target,scale-draft,scale-treeflash}/ (each with its train log and loss plot) and
# the record out/scale/scale-pair-train-<card>-<date>.json (a copy under results/).
# Env: GPUS (default: every GPU), MINUTES=T,D,F (training caps), COMPILE=1 (torch.compile the pieces around the SSD), TINY=1 (toy sizes).
# Usage (repo root): bench/scale_pair_gpu.sh OUT_DIR [TAG]
set -uo pipefail
out="${1:?usage: $0 OUT_DIR [TAG]}"
mkdir -p "$out"
rm -f "$out/DONE"
trap 'echo $? > "$out/DONE"' EXIT
exec >>"$out/scale-pair.log" 2>&1
set -e
source bench/gpu_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
python3 -c "import torch; from stree.training.ssd import ssd_backend; \
print('torch', torch.__version__, 'SSD:', ssd_backend('cuda'))"
args=(--out "$out" --gpus "$gpus")
[ -n "${2:-}" ] && args+=(--tag "$2")
[ "${COMPILE:-0}" = 1 ] && args+=(--compile)
[ "${TINY:-0}" = 1 ] && args+=(--tiny)
[ -n "${MINUTES:-}" ] && args+=(--minutes "$MINUTES")
python3 -m stree.cli bench scale-pair "${args[@]}" 2>&1 | tr '\r' '\n'
