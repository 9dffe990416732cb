#!/usr/bin/env bash
# The LoRA stacked form's GPU check (CUPYMOE_LORA_IN_GEMM: the experts' deltas as extra K of the
# TMA grouped GEMMs; cupymoe/lora_stack.py, DECISIONS.md "LoRA in the GEMM"), one command, < 4 min:
#   1. tests/test_gpu_lora.py -k stacked (the tests force the knob themselves: N 67 / 300 / 1100,
#      ranks 16 / 5 / 3 / 2 / 1, parts 1 and 2, the variants auto (gather_wide gate/up, tma_192
#      down), tma, tma_wide, tma_192; ids -1 and past the slots; one expert with most rows; Bext's
#      packing; ids -1 = the base layer's values; a graph captured before set_lora);
#   2. bench --lora 4 --lora-rank 16 at N = 1024, 4096 for qwen3-30b-a3b and deepseek-v3 (bf16),
#      without and with the knob (1: s t as one bf16; with PARTS2=1 also qwen3 with 2: two parts,
#      ~25 s more), JSON into $OUT.
#
#   OUT=/tmp/out bash scripts/lora_in_gemm_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py -k stacked \
  > "$DEST/lig_tests.log" 2>&1
echo "stacked tests rc $?: $(tail -1 "$DEST/lig_tests.log")"
grep -E "FAILED|ERROR|Error" "$DEST/lig_tests.log" | head -8

bench() {
  local preset=$1 knob=$2
  CUPYMOE_LORA_IN_GEMM=$knob timeout 25 python3 -m cupymoe bench --preset "$preset" --tokens 1024 4096 --lora 4 \
    --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/lig_${preset}_k$knob.json" \
    > "$DEST/lig_${preset}_k$knob.log" 2>&1
  echo "bench $preset CUPYMOE_LORA_IN_GEMM=$knob rc $?"
  grep "N=" "$DEST/lig_${preset}_k$knob.log"
}
bench qwen3-30b-a3b 0
bench qwen3-30b-a3b 1
bench deepseek-v3 0
bench deepseek-v3 1
if [ "${PARTS2:-0}" = 1 ]; then bench qwen3-30b-a3b 2; fi  # two parts of s t: 2 more gate/up K steps, 1 more down
