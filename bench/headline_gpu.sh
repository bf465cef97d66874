#!/usr/bin/env bash
# The headline measurements in two device calls on the 4-GPU machine (nvidia-h100-x4), about 9 minutes each.
#
#   PHASE=start : the scale pair starts training, detached, on GPUs 2 and 3 (bench/scale_pair_gpu.sh, capped at
#                 MINUTES=4,1.2,0.8); meanwhile GPU 0 runs the exact engine GPU tests in fp16 on the hybrid target
#                 then `stree bench numerics` (2.7B shape, bf16, exact vs fast vs mamba_ssm), and GPU 1 the exact
#                 tests of the Hugging Face families then the lookup e2e on the demo pair (every prompt set, bf16,
#                 T=0: e2e-lookup-demo-TAG.json), each time-limited (SEL_S, NUMERICS_S, LOOKUP_S).
#   PHASE=finish: waits for the training to end, then runs on the scale pair, one GPU each: the e2e table on
#                 HumanEval, in-domain and MT-Bench (plain, mamba_ssm, chain, static, beam, TreeFlash, auto; T=0 and
#                 T=1; DTYPE, default bf16; n-gram and retrieval too; merged into e2e-scale-TAG.json), the lookup e2e
#                 on the copy-heavy sets (e2e-lookup-TAG.json),
#                 `stree bench batch` at batch 1/4/16/64 (batch-scale-TAG.json), and the HumanEval acceptance of
#                 chain and beam replayed at the 2.7B shape (projection-METHOD-TAG.json).
# On the 2-GPU machine the pair trains on GPU 1 alone, GPU 0 runs the tests, the probe and the bf16 e2e, then
# PHASE=profile runs the training profiles and the numerics on GPU 0, and PHASE=finish the e2e sets on both GPUs.
# The finish phase waits for the training (WAIT_S) and then needs about 8 minutes: start it detached
# (setsid nohup ... &) in a call that polls for "finish summary" in its log, as a call may run 10 minutes at most.
# Records land in OUT_DIR (copy them to results/); a short table prints last.
# Usage (repo root): PHASE=start|finish bench/headline_gpu.sh OUT_DIR [TAG]
set -uo pipefail
phase=${PHASE:?PHASE=start, profile (2 GPUs) or finish}
keep=/tmp/stree-lease  # lives on the machine between the two calls
mkdir -p "$keep"
tag_arg=${2:-h100-$(date +%Y%m%d)}
source bench/gpu_start.sh "$@"  # installs once into /tmp/stree-site; the training below reuses it
n_gpu=$(nvidia-smi -L | wc -l)
train_gpus=$([ "$n_gpu" -ge 4 ] && echo 2,3 || echo 1)  # on 2 GPUs: training on GPU 1, every other lane on GPU 0
if [ "$phase" = start ]; then
  (CUDA_VISIBLE_DEVICES=$train_gpus GPUS=$(echo $train_gpus | tr , '\n' | wc -l) MINUTES=${MINUTES:-4,1.2,0.8} \
     setsid nohup bench/scale_pair_gpu.sh "$keep/scale" "$tag_arg" >/dev/null 2>&1 </dev/null &)
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
data=(--mt-bench .data/mt_bench.jsonl --spec-bench .data/spec_bench.jsonl --gsm8k .data/gsm8k.jsonl)
e2e() {  # e2e GPU SECONDS NAME ARGS...: one e2e run on one GPU, its table in OUT/NAME.txt, its record OUT/NAME.json
  local gpu=$1 secs=$2 name=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$secs" python3 -m stree.cli bench e2e "${data[@]}" --num-prompts 8 \
    --max-new-tokens 128 --out "$out/$name.json" "$@" 2>&1 | tr '\r' '\n' | grep -v 'it/s\]$' > "$out/$name.txt"
}
profile_lane() {  # profile_lane GPU: the training-step profiles (8 and 16 rows a micro-batch)
  CUDA_VISIBLE_DEVICES=$1 timeout 100 python3 bench/train_profile.py > "$out/train-profile-$tag.txt" 2>&1
  CUDA_VISIBLE_DEVICES=$1 timeout 100 python3 bench/train_profile.py --rows 16 --top 12 \
    > "$out/train-profile-16-$tag.txt" 2>&1
}
numerics_lane() {  # numerics_lane GPU: the 2.7B-shape numerics (exact vs fast vs mamba_ssm)
  CUDA_VISIBLE_DEVICES=$1 timeout "${NUMERICS_S:-200}" python3 -m stree.cli bench numerics --reps 10 \
    --out "$out/numerics-$tag.json" > "$out/numerics-$tag.txt" 2>&1
}
if [ "$phase" = start ] && [ "$n_gpu" -lt 4 ]; then
  gpu_test_files 0 100 tests/gpu/test_exact_ops_gpu.py tests/gpu/test_exact_engine_gpu.py
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/exact_probe.py > "$out/exact-probe-$tag.txt" 2>&1
  e2e 0 170 "e2e-exact-bf16-$tag" --dtype bfloat16 --temperatures 0 \
    --prompt-sets humaneval,mt_bench,gsm8k,spec_bench,in_domain --methods plain,chain,static,beam,treeflash,auto,ngram
elif [ "$phase" = start ]; then  # 4 GPUs: what the 2-GPU sessions left unfinished beside the training
  (gpu_tests 0 "${SEL_S:-250}" tests/gpu/test_exact_engine_gpu.py "every_drafter and hybrid and dtype1"
   numerics_lane 0) &
  (gpu_tests 1 "${SEL_S:-250}" tests/gpu/test_exact_engine_gpu.py "hf_family"
   e2e 1 "${LOOKUP_S:-230}" "e2e-lookup-demo-$tag" --dtype bfloat16 --temperatures 0 \
     --prompt-sets humaneval,mt_bench,gsm8k,spec_bench,in_domain,code_edit,spec_bench_copy \
     --methods plain,ngram,retrieval,auto,fusion-auto) &
  wait
fi
if [ "$phase" = start ]; then
  echo "===== start summary ($tag)"
  cat "$out/lanes-$tag.txt"
  grep -hE "^FAILED|^ERROR|^E  " "$out"/test_*-"$tag".txt | head -12 | cut -c1-260
  grep -E "exact-probe|Error" "$out/exact-probe-$tag.txt" 2>/dev/null | cut -c1-200
  tail -n 22 "$out/numerics-$tag.txt" | cut -c1-200
  tail -n 40 "$out"/e2e-*-"$tag".txt | cut -c1-200
  echo "----- scale pair so far"
  tail -n 6 "$keep/scale/scale-pair.log" | cut -c1-300
  exit 0
fi
if [ "$phase" = profile ]; then  # 2 GPUs: GPU 0 profiles training and times the numerics while the pair trains
  profile_lane 0
  numerics_lane 0
  grep -A30 "kernels of one step" "$out/train-profile-$tag.txt" | cut -c1-170
  tail -n 2 "$out/train-profile-16-$tag.txt" | cut -c1-300
  tail -n 22 "$out/numerics-$tag.txt" | cut -c1-200
  echo "----- scale pair so far"
  tail -n 6 "$keep/scale/scale-pair.log" | cut -c1-300
  exit 0
fi
# finish
for _ in $(seq 1 "${WAIT_S:-240}"); do [ -f "$keep/scale/DONE" ] && break; sleep 1; done
cp "$keep/scale/scale-pair.log" "$keep"/scale/scale-pair-train-*.json "$out/" 2>/dev/null
cp "$keep"/scale/pair/*/train*.{png,jsonl,log} "$out/" 2>/dev/null
echo "scale pair DONE=$(cat "$keep/scale/DONE" 2>/dev/null || echo still-running)"
grep -E "^\[scale-pair\]" "$keep/scale/scale-pair.log" | tail -6 | cut -c1-400
pair="$keep/scale/pair"
dtype=${DTYPE:-bfloat16}  # exact in bf16 since the walk and counter fixes (BENCHMARKS section 0)
scale=(--target "$pair/scale-target" --draft "$pair/scale-draft" --treeflash "$pair/scale-treeflash" --dtype "$dtype")
secs=${E2E_S:-330}
merge_sets() {  # the per-set records as one: OUT/e2e-scale-TAG.json (the trees issue's record name)
  local sets=()
  for set in humaneval in_domain mt_bench; do
    [ -f "$out/e2e-scale-$set-$tag.json" ] && sets+=("$out/e2e-scale-$set-$tag.json")
  done
  [ ${#sets[@]} -gt 0 ] && python3 -m stree.cli bench merge "$out/e2e-scale-$tag.json" "${sets[@]}"
}
if [ "$n_gpu" -lt 4 ]; then  # two lanes: the three sets at T=0 and T=1, then the lookup sets
  (e2e 0 "$secs" "e2e-scale-humaneval-$tag" "${scale[@]}" --prompt-sets humaneval --temperatures 0,1 \
     --methods plain,chain,static,beam,treeflash,auto
   e2e 0 "$secs" "e2e-scale-mt_bench-$tag" "${scale[@]}" --prompt-sets mt_bench --temperatures 0,1 \
     --methods plain,chain,static,beam,treeflash,auto) &
  (e2e 1 "$secs" "e2e-scale-in_domain-$tag" "${scale[@]}" --prompt-sets in_domain --temperatures 0,1 \
     --methods plain,chain,static,beam,treeflash,auto
   e2e 1 "$secs" "e2e-lookup-$tag" "${scale[@]}" --prompt-sets code_edit,spec_bench_copy --temperatures 0 \
     --methods plain,ngram,retrieval,beam,ngram-tree,fusion-ngram,fusion-auto) &
  wait
  merge_sets
  echo "===== finish summary ($tag)"
  for f in "$out"/e2e-*-"$tag".txt; do echo "--- $(basename "$f")"; tail -n 30 "$f" | cut -c1-200; done
  exit 0
fi
project() {  # project GPU METHOD TREE: the scale pair's HumanEval acceptance by depth of METHOD replayed at the 2.7B
  # shape, batch 1 and 16 (the oracle's costs; the drafter's own cost left out): OUT/projection-METHOD-TAG.json.
  # TREE must be deeper than METHOD's deepest accepted level (chain:4 accepts 4 levels, beam:5x4 five).
  local rec="$out/e2e-scale-humaneval-$tag.json"
  for _ in $(seq 1 120); do [ -f "$rec" ] && break; sleep 2; done  # the HumanEval lane writes it
  CUDA_VISIBLE_DEVICES=$1 timeout "${PROJECT_S:-200}" python3 -m stree.cli bench batch --skip-pair \
    --oracle-shape 2.7b --oracle-accept "$rec:$2" --oracle-tree "$3" \
    --batch-sizes 1,16 --out "$out/projection-$2-$tag.json" > "$out/projection-$2-$tag.txt" 2>&1
}
# four lanes of about 7 minutes each once the pair is trained: a prompt set each on GPUs 0-2, then a projection
# (GPUs 0, 1) or the copy-heavy lookup sets (GPU 2); the batch table alone on GPU 3
methods=plain,mamba_ssm,chain,static,beam,treeflash,auto,ngram,retrieval
(e2e 0 "$secs" "e2e-scale-humaneval-$tag" "${scale[@]}" --prompt-sets humaneval --temperatures 0,1 --methods $methods
 project 0 chain static:2,2,1,1,1) &
(e2e 1 "$secs" "e2e-scale-in_domain-$tag" "${scale[@]}" --prompt-sets in_domain --temperatures 0,1 --methods $methods
 project 1 beam static:2,2,1,1,1,1) &
(e2e 2 "$secs" "e2e-scale-mt_bench-$tag" "${scale[@]}" --prompt-sets mt_bench --temperatures 0,1 --methods $methods
 e2e 2 "${LOOKUP_S:-280}" "e2e-lookup-$tag" "${scale[@]}" --prompt-sets code_edit,spec_bench_copy --temperatures 0 \
   --methods plain,ngram,retrieval,auto,beam,ngram-tree,fusion-ngram,fusion-auto) &
(CUDA_VISIBLE_DEVICES=3 timeout "${BATCH_S:-450}" python3 -m stree.cli bench batch --target "$pair/scale-target" \
   --draft "$pair/scale-draft" --dtype "$dtype" --batch-sizes 1,4,16,64 --temperatures 0,1 --repeats 2 \
   --data-dir .data --out "$out/batch-scale-$tag.json" > "$out/batch-scale-$tag.txt" 2>&1) &
wait
merge_sets
echo "===== finish summary ($tag)"
for f in "$out"/e2e-*-"$tag".txt "$out/batch-scale-$tag.txt" "$out"/projection-*-"$tag".txt; do echo "--- $(basename "$f")"; tail -n 30 "$f" | cut -c1-200; done
