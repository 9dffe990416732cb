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
. "$(dirname "$0")/lora_bench.sh"  # DEST, the repository root, lora_tests, lora_bench
lora_tests 170 lora_gpu

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

lora_bench_presets 40 40 lora "1 64 1024 4096"
