#!/usr/bin/env bash
# The LoRA kernels' GPU check (per-pair kernels with each item's shrink split over slices and a
# ticket-elected last block; the grouped deltas' chunks over grid y and down's columns over grid
# z; issue 42) in one command, under 4.5 minutes:
#   1. tests/test_gpu_lora.py (with test_sliced_pair_deltas: H = 776, I = 392, slices > 1 on
#      decode, atomic and one-block prefill, ranks 16 / 12 / 5 / 3 / 1, ids -1 and past the slots,
#      each forward twice bit for bit; test_grouped_deltas_split_grid: H = 1544 in 3 uneven
#      column slices, 4 and 6 slots (4 and 8 blocks a tile), row invariance bit for bit);
#   2. the expert-delta tests with the dispatch forced onto other gate/up families;
#   3. bench --lora 4 --lora-rank 16 at N = 1, 64, 1024, 4096 for qwen3-30b-a3b and deepseek-v3,
#      bf16 and fp8_block (w8a16), JSON into $OUT/lora_<preset>_<format>.json.
#
#   OUT=/tmp/out bash scripts/lora_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "$DEST/lora_gpu_tests.log" 2>&1
echo "test_gpu_lora rc $?: $(tail -1 "$DEST/lora_gpu_tests.log")"
grep -E "FAILED|ERROR" "$DEST/lora_gpu_tests.log" | head -8

forced() {
  local name=$1
  shift
  env "$@" timeout 20 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py -k "expert_deltas or sliced" \
    > "$DEST/lora_forced_$name.log" 2>&1
  echo "forced $name rc $?: $(tail -1 "$DEST/lora_forced_$name.log")"
  grep -E "FAILED|ERROR" "$DEST/lora_forced_$name.log" | head -4
}
forced twin_wgmma CUPYMOE_MATH_ROWS=1 CUPYMOE_SM90_VARIANT=twin CUPYMOE_FP4_DECODE=wgmma
forced cores CUPYMOE_FP4_DECODE=cores CUPYMOE_FP8_DECODE=cores
forced swapab CUPYMOE_DECODE_KERNEL=swapab  # bf16 decode by the swap-AB kernel (ACT_PAIR into lora_gu)

bench() {
  local preset=$1 fmt=$2
  shift 2
  timeout 40 python3 -m cupymoe bench --preset "$preset" --format "$fmt" --tokens 1 64 1024 4096 --lora 4 \
    --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/lora_${preset}_$fmt.json" "$@" \
    > "$DEST/lora_${preset}_$fmt.log" 2>&1
  echo "bench $preset $fmt rc $?"
  grep "N=" "$DEST/lora_${preset}_$fmt.log"
}
bench qwen3-30b-a3b bf16
bench qwen3-30b-a3b fp8_block --fp8-compute w8a16
bench deepseek-v3 bf16
bench deepseek-v3 fp8_block --fp8-compute w8a16
