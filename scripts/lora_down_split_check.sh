#!/usr/bin/env bash
# What lora_down_delta's blocks of one pair split (CUPYMOE_LORA_DOWN_SPLIT: cols | shrink) in one device call:
# the split's GPU tests (SUITE=0, the default) or the GPU suite (SUITE=1: scripts/device_check.sh PARTS=tests),
# then bench --lora 4 --lora-rank 16 at TOKENS (default "1 8 32") for each form of FORMS (default
# "cols shrink"), the forms alternating within each round (ROUNDS, default 2), PRESETS (default
# qwen3-30b-a3b) in bf16 and fp8_block as w8a16, and once for ONCE's presets; then (TIMELINE=1) the LoRA forward at
# one row on the timeline for each form. Logs and JSON as $OUT/run.tgz (the suite's as $OUT/check.tgz).
#
#   OUT=/tmp/out bash scripts/lora_down_split_check.sh    (.whl carried)
. "$(dirname "$0")/lora_bench.sh"
lora_scratch
if [ "${SUITE:-0}" = 1 ]; then
  OUT=$DEST PARTS=tests SHARD_S=${SHARD_S:-220} bash scripts/device_check.sh
else
  KERNELS=0 TESTS_S=240 bash scripts/gpu_tests.sh "$DEST" "by_columns or early or fold" split tests/test_gpu_lora.py
fi
FORMS=${FORMS:-cols shrink}
bench() {  # preset format form tag [more bench arguments]
  local preset=$1 fmt=$2 form=$3 tag=$4
  shift 4
  # shellcheck disable=SC2086  # the token counts split on purpose
  CUPYMOE_LORA_DOWN_SPLIT=$form timeout 200 python3 -P -m cupymoe bench --no-peers --preset "$preset" --format "$fmt" \
    --tokens ${TOKENS:-1 8 32} --lora 4 --lora-rank 16 --repeats 9 --replays 20 --json "$W/$tag.json" "$@" \
    > "$W/$tag.log" 2>&1
  echo "$tag ($(( $(date +%s) - t0 )) s): $(grep -E 'N=' "$W/$tag.log" | grep -o 'N=[0-9]*\|LoRA.*' | tr '\n' ' ')"
}
forms() {  # preset round
  for form in $FORMS; do
    bench "$1" bf16 "$form" "$1-bf16-$form-$2"
    bench "$1" fp8_block "$form" "$1-fp8-$form-$2" --fp8-compute w8a16
  done
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for preset in ${PRESETS:-qwen3-30b-a3b}; do forms "$preset" "$round"; done
done
for preset in ${ONCE:-}; do forms "$preset" 1; done
if [ "${TIMELINE:-1}" = 1 ]; then
  for form in $FORMS; do
    CUPYMOE_LORA_DOWN_SPLIT=$form timeout 100 python3 -P scripts/graph_timeline.py --preset qwen3-30b-a3b --tokens 1 \
      --lora 4 > "$W/timeline-$form.log" 2>&1
    echo "timeline $form:"; grep -E "lora|span" "$W/timeline-$form.log"
  done
fi
