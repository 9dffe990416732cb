#!/usr/bin/env bash
# A LoRA plan knob's values against each other in one device call: the LoRA GPU tests selected by TESTS_K
# (SUITE=0, the default; TESTS=0: none) or the GPU suite (SUITE=1: scripts/device_check.sh PARTS=tests), then
# bench --lora 4 --lora-rank 16 at TOKENS (default "1 8 32") with KNOB (an environment variable) set to each of
# FORMS, the values alternating within each round (ROUNDS, default 2), PRESETS (default qwen3-30b-a3b) in FORMATS
# (default "bf16 fp8_block", fp8_block as w8a16), and once for ONCE's presets; then (TIMELINE=1) the LoRA forward on the timeline for each
# value (TL_TOKENS rows, default 1). Logs and JSON as $OUT/run.tgz (the suite's as $OUT/check.tgz).
#
#   OUT=/tmp/out KNOB=CUPYMOE_LORA_DOWN_SPLIT FORMS="cols shrink" bash scripts/lora_knob_check.sh    (.whl carried)
. "$(dirname "$0")/lora_bench.sh"
lora_scratch
KNOB=${KNOB:?set KNOB to a CUPYMOE_ variable}
FORMS=${FORMS:?set FORMS to its values}
if [ "${SUITE:-0}" = 1 ]; then
  OUT=$DEST PARTS=tests SHARD_S=${SHARD_S:-220} bash scripts/device_check.sh
elif [ "${TESTS:-1}" = 1 ]; then
  KERNELS=0 TESTS_S=240 bash scripts/gpu_tests.sh "$DEST" "${TESTS_K:-by_columns or early or fold}" lora \
    tests/test_gpu_lora.py
fi
bench() {  # preset format value tag [more bench arguments]
  local preset=$1 fmt=$2 value=$3 tag=$4
  shift 4
  # shellcheck disable=SC2086  # the token counts split on purpose
  env "$KNOB=$value" timeout 200 python3 -P -m cupymoe bench --no-peers --preset "$preset" --format "$fmt" \
    --tokens ${TOKENS:-1 8 32} --lora 4 --lora-rank 16 --repeats 9 --replays 20 --json "$W/$tag.json" "$@" \
    > "$W/$tag.log" 2>&1
  echo "$tag ($(( $(date +%s) - t0 )) s): $(grep -E 'N=' "$W/$tag.log" | grep -o 'N=[0-9]*\|LoRA.*' | tr '\n' ' ')"
}
values() {  # preset round
  for value in $FORMS; do
    for fmt in ${FORMATS:-bf16 fp8_block}; do
      if [ "$fmt" = bf16 ]; then bench "$1" bf16 "$value" "$1-bf16-$value-$2"
      else bench "$1" fp8_block "$value" "$1-fp8-$value-$2" --fp8-compute w8a16; fi
    done
  done
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for preset in ${PRESETS:-qwen3-30b-a3b}; do values "$preset" "$round"; done
done
for preset in ${ONCE:-}; do values "$preset" 1; done
if [ "${TIMELINE:-1}" = 1 ]; then
  for tl in ${TL_TOKENS:-1}; do
    for value in $FORMS; do
      env "$KNOB=$value" timeout 100 python3 -P scripts/graph_timeline.py --preset qwen3-30b-a3b --tokens "$tl" \
        --lora 4 > "$W/timeline-$value-$tl.log" 2>&1
      echo "timeline N=$tl $KNOB=$value:"; grep -E "start|span" "$W/timeline-$value-$tl.log"
    done
  done
fi
