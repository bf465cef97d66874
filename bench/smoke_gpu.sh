#!/usr/bin/env bash
# A first, short device call before the long run (about 8 minutes on the 4-GPU machine): every GPU test file, in
# lanes pinned to the GPUs and each file time-limited (one slow or hung file cannot eat the call), a toy scale-pair
# training run through mamba_ssm's kernels on two GPUs (DDP), and one numerics row. Prints a summary last; full
# logs under OUT_DIR.
# Usage (repo root): bench/smoke_gpu.sh OUT_DIR [TAG]
set -uo pipefail
source bench/gpu_start.sh "$@"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
ngpu=$(nvidia-smi -L | wc -l)
files=(${GPU_TEST_FILES:-tests/gpu/test_exact_ops_gpu.py tests/gpu/test_exact_engine_gpu.py tests/gpu/test_gpu.py
       tests/gpu/test_engine_gpu.py tests/gpu/test_lookup_gpu.py tests/gpu/test_training_gpu.py
       tests/gpu/test_hf_kernels.py tests/gpu/test_sampled_verify_gpu.py tests/gpu/test_pdl_gpu.py})
lanes=$(( ngpu > 2 ? ngpu - 1 : 1 ))  # the last GPU (of 3+) runs the toy training beside the tests
for ((k = 0; k < lanes; k++)); do
  mine=(); for ((i = k; i < ${#files[@]}; i += lanes)); do mine+=("${files[i]}"); done
  gpu_test_files "$k" "${PER_FILE_TIMEOUT:-200}" "${mine[@]}" &
done
if [ "${TRAIN:-1}" = 1 ]; then
  train_gpus=$(( ngpu > 2 ? ngpu - 1 : 0 ))
  (CUDA_VISIBLE_DEVICES=$train_gpus,$(( ngpu > 3 ? ngpu - 2 : train_gpus )) \
     GPUS=$(( ngpu > 3 ? 2 : 1 )) TINY=1 \
     timeout 300 bench/scale_pair_gpu.sh "$out/scale-tiny" "$tag") &
fi
wait
if [ "${NUMERICS:-1}" = 1 ]; then
  timeout 120 python3 -m stree.cli bench numerics --batches 1 --nodes 16 --reps 10 --out "$out/numerics-smoke-$tag.json" \
    > "$out/numerics-smoke-$tag.txt" 2>&1
  echo "numerics rc=$?" >> "$out/lanes-$tag.txt"
fi
echo "===== smoke summary ($tag)"
cat "$out/lanes-$tag.txt"
[ -f "$out/scale-tiny/DONE" ] && echo "scale-pair tiny DONE=$(cat "$out/scale-tiny/DONE")" && \
  grep -E "SSD:|target_params|Error|error" "$out/scale-tiny/scale-pair.log" | tail -5 | cut -c1-300
tail -n 25 "$out/numerics-smoke-$tag.txt" 2>/dev/null | cut -c1-200
for f in "$out"/test_*-"$tag".txt; do grep -E "^FAILED|^ERROR" "$f" | head -4 | cut -c1-250; done
