#!/usr/bin/env bash
# Exactness diagnosis and the training profile on the 2-GPU machine (nvidia-h100-x2), about 9 minutes.
#   GPU 0: bench/exact_probe.py (where a random scale-shape hybrid's tree pass, commit, prefill or engine run first
#          leaves plain decode steps), then the exact engine tests one selection at a time, each time-limited;
#   GPU 1: `stree bench numerics` (2.7B shape, bf16, exact vs fast vs mamba_ssm), bench/train_profile.py eager and
#          compiled, then the 2.7B-shape exact engine tests.
# Outputs in OUT_DIR; a short table prints last. Usage (repo root): bench/exact_gpu.sh OUT_DIR [TAG]
set -uo pipefail
source bench/gpu_start.sh "$@"
tests() {  # tests GPU SECONDS K-EXPRESSION: one selection of the exact engine tests (gpu_tests)
  gpu_tests "$1" "$2" tests/gpu/test_exact_engine_gpu.py "$3"
}
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/exact_probe.py > "$out/exact-probe-$tag.txt" 2>&1
 tests 0 90 "every_drafter and mamba2 and dtype0"
 tests 0 90 "every_drafter and hybrid and dtype0"
 tests 0 80 "every_drafter and hybrid and dtype2"
 tests 0 70 "request_alone") &
(CUDA_VISIBLE_DEVICES=1 timeout 130 python3 -m stree.cli bench numerics --reps 10 \
   --out "$out/numerics-$tag.json" > "$out/numerics-$tag.txt" 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 90 python3 bench/train_profile.py > "$out/train-profile-$tag.txt" 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 140 python3 bench/train_profile.py --compile --top 12 \
   > "$out/train-profile-compile-$tag.txt" 2>&1
 tests 1 100 "2p7b_shape_every") &
wait
echo "===== exact summary ($tag)"
cat "$out/lanes-$tag.txt"
grep -hE "^FAILED|^E  .*assert|^E  +\[|^E  +AssertionError" "$out"/test_exact_engine_gpu-*-"$tag".txt | head -20 | cut -c1-300
grep -E "exact-probe|Error" "$out/exact-probe-$tag.txt" | cut -c1-300
grep -A30 "kernels of one step" "$out/train-profile-$tag.txt" | cut -c1-170
tail -n 4 "$out/train-profile-compile-$tag.txt" | cut -c1-300
tail -n 22 "$out/numerics-$tag.txt" | cut -c1-200
