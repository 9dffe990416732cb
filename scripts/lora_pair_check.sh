#!/usr/bin/env bash
# The GPU check of the one-pass LoRA gate/up (ACT_PAIR: each gate/up GEMM of a LoRA plan stores
# g and u side by side into lora_gu, once) in one command, under 4 minutes:
#   1. tests/test_gpu_lora.py: every path and base format against the reference, by the
#      dispatch's own kernel choices;
#   2. the LoRA overhead of qwen3-30b-a3b bf16 at N = 1, 64, 1024, 4096 (rank 16, 4 adapters
#      round-robin over the rows; issue 42's cell), JSON into $OUT/lora_pair_bench.json;
#   3. the expert-delta tests again with the dispatch forced onto the gate/up families the
#      tiny configs may not reach by themselves (Hopper wgmma at every prefill N, cp.async and
#      TMA with 256-column tiles, the fp4 decode on wgmma, on mma and on CUDA cores).
# Logs in $OUT; the summary lines on stdout.
#
#   OUT=/tmp/out bash scripts/lora_pair_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 115 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "$DEST/lora_gpu_tests.log" 2>&1
echo "test_gpu_lora rc $?: $(tail -1 "$DEST/lora_gpu_tests.log")"
grep -E "FAILED|ERROR" "$DEST/lora_gpu_tests.log" | head -8

timeout 60 python3 -m cupymoe bench --preset qwen3-30b-a3b --format bf16 --tokens 1 64 1024 4096 --lora 4 \
  --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/lora_pair_bench.json" \
  > "$DEST/lora_pair_bench.log" 2>&1
echo "bench rc $?"
grep "N=" "$DEST/lora_pair_bench.log"

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
