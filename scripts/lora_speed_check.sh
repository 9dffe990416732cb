#!/usr/bin/env bash
# The LoRA shrinks' GPU check (DECISIONS.md "LoRA: the shrinks' overheads"), one command, < 150 s
# with a warm kernel cache:
#   1. tests/test_gpu_lora.py whole (the stacked and grouped cases, the router's row groups, every path);
#   2. bench --lora 4 --lora-rank 16 at N = 64, 1024, 4096 for qwen3-30b-a3b and deepseek-v3 (bf16,
#      the stacked form on by default), JSON into $OUT.
#
#   OUT=/tmp/out bash scripts/lora_speed_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "$DEST/lsc_tests.log" 2>&1
echo "tests rc $?: $(tail -1 "$DEST/lsc_tests.log")"
grep -E "FAILED|ERROR|Error" "$DEST/lsc_tests.log" | head -8

for preset in qwen3-30b-a3b deepseek-v3; do
  short=${preset%%-*}
  timeout 35 python3 -m cupymoe bench --preset "$preset" --tokens 64 1024 4096 --lora 4 --lora-rank 16 --no-peers \
    --repeats 5 --replays 10 --json "$DEST/lsc_$short.json" > "$DEST/lsc_$short.log" 2>&1
  echo "bench $preset rc $?"
  grep "N=" "$DEST/lsc_$short.log"
done
