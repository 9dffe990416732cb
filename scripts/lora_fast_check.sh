#!/usr/bin/env bash
# The GPU check of the fast LoRA deltas (vectorized per-pair kernels on decode / atomic, the
# grouped tensor-core kernels lora_grouped_* on prefill) in one command, under 4 minutes:
#   1. tests/test_gpu_lora.py: every path and base format against the reference, and the grouped
#      deltas' own tests (awkward N up to 1100, ranks 32 / 16 / 12 / 5 beside 3, 1, 2, ids -1 and
#      past the slots, one expert with most rows, graph replay and row invariance bit for bit);
#   2. the expert-delta tests again with the dispatch forced onto the gate/up families the tiny
#      configs may not reach by themselves (as scripts/lora_pair_check.sh);
#   3. the LoRA overhead (rank 16, 4 adapters round-robin; issue 42's cells) at N = 1, 64, 1024,
#      4096 of qwen3-30b-a3b bf16, qwen3-30b-a3b fp8_block (w8a16) and deepseek-v3 bf16, JSON into
#      $OUT/lora_fast_<preset>_<format>.json.
# Logs in $OUT; the summary lines on stdout.
#
#   OUT=/tmp/out bash scripts/lora_fast_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "$DEST/lora_gpu_tests.log" 2>&1
echo "test_gpu_lora rc $?: $(tail -1 "$DEST/lora_gpu_tests.log")"
grep -E "FAILED|ERROR" "$DEST/lora_gpu_tests.log" | head -8

# name, then the knobs (cupymoe/knobs.py) of one forced pass over the expert-delta tests
forced() {
  local name=$1
  shift
  env "$@" timeout 20 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py -k expert_deltas \
    > "$DEST/lora_forced_$name.log" 2>&1
  echo "forced $name rc $?: $(tail -1 "$DEST/lora_forced_$name.log")"
  grep -E "FAILED|ERROR" "$DEST/lora_forced_$name.log" | head -4
}
forced twin_wgmma CUPYMOE_MATH_ROWS=1 CUPYMOE_SM90_VARIANT=twin CUPYMOE_FP4_DECODE=wgmma
forced wide_mma CUPYMOE_MATH_ROWS=1 CUPYMOE_SM90_VARIANT=tma_wide CUPYMOE_FP4_DECODE=mma
forced cores CUPYMOE_FP4_DECODE=cores CUPYMOE_FP8_DECODE=cores

# seconds, preset, format, then extra bench flags
bench() {
  local limit=$1 preset=$2 fmt=$3
  shift 3
  timeout "$limit" python3 -m cupymoe bench --preset "$preset" --format "$fmt" --tokens 1 64 1024 4096 --lora 4 \
    --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/lora_fast_${preset}_$fmt.json" "$@" \
    > "$DEST/lora_fast_${preset}_$fmt.log" 2>&1
  echo "bench $preset $fmt rc $?"
  grep "N=" "$DEST/lora_fast_${preset}_$fmt.log"
}
bench 45 qwen3-30b-a3b bf16
bench 45 qwen3-30b-a3b fp8_block --fp8-compute w8a16
bench 70 deepseek-v3 bf16
