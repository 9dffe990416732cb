#!/usr/bin/env bash
# CUPYMOE_LORA_FOLD (at one decode row the LoRA router delta's shrink as blocks of the router's grid
# and its expand inside the routing launch, forward_plan.lora_fold) in one device call: the GPU suite (SUITE=1, the
# default: scripts/device_check.sh PARTS=tests) or the fold's own GPU tests (SUITE=0), then bench
# --lora 4 --lora-rank 16 at one row, the fold on and off alternating (ROUNDS, default 2) for
# PRESETS (default qwen3-30b-a3b), bf16 and fp8_block as w8a16, and once for ONCE's presets; then (TIMELINE=1) the LoRA forward's
# kernels on the timeline, fold on and off (scripts/graph_timeline.py). Logs and JSON as $OUT/run.tgz (the
# suite's as $OUT/check.tgz).
#
#   OUT=/tmp/out bash scripts/lora_fold_check.sh    (.whl carried)
. "$(dirname "$0")/lora_bench.sh"
lora_scratch
if [ "${SUITE:-1}" = 1 ]; then
  OUT=$DEST PARTS=tests SHARD_S=${SHARD_S:-220} bash scripts/device_check.sh
else
  KERNELS=0 TESTS_S=200 bash scripts/gpu_tests.sh "$W" "fold" tests tests/test_gpu_lora.py
fi
bench() {  # preset format fold tag [more bench arguments]
  local preset=$1 fmt=$2 fold=$3 tag=$4
  shift 4
  CUPYMOE_LORA_FOLD=$fold timeout 150 python3 -P -m cupymoe bench --no-peers --preset "$preset" --format "$fmt" \
    --tokens ${TOKENS:-1} --lora 4 --lora-rank 16 --repeats 9 --replays 20 --json "$W/$tag.json" "$@" > "$W/$tag.log" 2>&1
  echo "$tag ($(( $(date +%s) - t0 )) s): $(grep -E 'N=' "$W/$tag.log" | grep -o 'N=[0-9]*\|LoRA.*' | tr '\n' ' ')"
}
pairs() {  # preset round: both formats, the fold on then off
  for fold in 1 0; do
    bench "$1" bf16 $fold "$1-bf16-fold$fold-$2"
    bench "$1" fp8_block $fold "$1-fp8-fold$fold-$2" --fp8-compute w8a16
  done
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for preset in ${PRESETS:-qwen3-30b-a3b}; do pairs "$preset" "$round"; done
done
for preset in ${ONCE:-}; do pairs "$preset" 1; done
if [ "${TIMELINE:-1}" = 1 ]; then
  for fold in 1 0; do
    CUPYMOE_LORA_FOLD=$fold timeout 100 python3 -P scripts/graph_timeline.py --preset qwen3-30b-a3b --tokens 1 --lora 4 \
      > "$W/timeline-fold$fold.log" 2>&1
    echo "timeline fold $fold:"; grep -E "start|span" "$W/timeline-fold$fold.log"
  done
fi
