#!/usr/bin/env bash
# CUPYMOE_LORA_STACK_SHRINK (the stacked form's shrinks as chunks of one adapter, or by (tile, adapter)
# segments on a cp.async ring, lora_stack_t_seg) in one device call: the stacked-form GPU tests of the
# segments form, judged against the reference; the shrink kernels' times (Nsight Compute, qwen3-30b-a3b
# bf16 1024 and 4096 rows, each form); then bench --lora at qwen3-30b-a3b bf16 and fp8_block (w8a16)
# 1024 / 4096 rows, the forms alternating (ROUNDS; FORMS, default "chunks segments"), and deepseek-v3
# once each (DEEPSEEK=0 skips it).
# Logs and JSON as $OUT/run.tgz.
#
#   OUT=/tmp/out bash scripts/lora_shrink_gemm_check.sh    (.whl carried; ROUNDS, default 2; TESTS=0 skips them)
. "$(dirname "$0")/lora_bench.sh"
lora_scratch
if [ "${TESTS:-1}" = 1 ]; then
  KERNELS=0 TESTS_S=260 bash scripts/gpu_tests.sh "$W" "stacked and segments" tests tests/test_gpu_lora.py
fi
for sh in ${FORMS:-chunks segments}; do
  CUPYMOE_LORA_STACK_SHRINK=$sh timeout 120 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum \
    -k regex:lora_stack_t --print-summary per-kernel python3 scripts/stage_times.py --preset qwen3-30b-a3b --format bf16 \
    --tokens 1024 4096 --reps 1 --lora 4 --lora-rank 16 > "$W/ncu-$sh.log" 2>&1
  echo "ncu $sh: $(grep -E 'lora_stack_t|gpu__time_duration' "$W/ncu-$sh.log" | sed -E 's/\(const [^)]*\)//' | grep -oE 'lora_stack_t_[a-z_]+(<[0-9, ]+>)? \([0-9]+|us[[:space:]]+[0-9.]+' | tr -s ' ' | tr '\n' ' ')"
done
bench() {  # preset format tokens shrink tag
  CUPYMOE_LORA_STACK_SHRINK=$4 timeout 150 python3 -P -m cupymoe bench --no-peers --preset "$1" --format "$2" \
    --tokens $3 --lora 4 --lora-rank 16 --repeats 7 --replays 10 --json "$W/$5.json" > "$W/$5.log" 2>&1
  echo "$5 ($(( $(date +%s) - t0 )) s): $(grep -E 'N=' "$W/$5.log" | grep -o 'N=[0-9]*\|LoRA.*' | tr '\n' ' ')"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for fmt in bf16 fp8_block; do
    for sh in ${FORMS:-chunks segments}; do bench qwen3-30b-a3b $fmt "1024 4096" $sh "qwen3-$fmt-$sh-$round"; done
  done
done
[ "${DEEPSEEK:-1}" = 1 ] && for fmt in bf16 fp8_block; do
  for sh in ${FORMS:-chunks segments}; do bench deepseek-v3 $fmt "1024 4096" $sh "deepseek-$fmt-$sh"; done
done
