#!/usr/bin/env bash
# The LoRA shrinks' GPU check (DECISIONS.md "LoRA: the shrinks' fixed costs"), one command, < 150 s
# with a warm kernel cache:
#   1. tests/test_gpu_lora.py whole (stacked and grouped cases, the router's row groups, every path);
#   2. bench --lora 4 --lora-rank 16 at N = 64, 1024, 4096 for qwen3-30b-a3b and deepseek-v3 (bf16,
#      the stacked form on by default), JSON into $OUT/lsc_<qwen3|deepseek>.json.
#
#   OUT=/tmp/out bash scripts/lora_speed_check.sh
set -u
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=${OUT:?set OUT to a folder for the logs}/lsc

timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "${log}_tests.log" 2>&1
echo "tests rc $?: $(tail -1 "${log}_tests.log")"; grep -E "FAILED|ERROR|Error" "${log}_tests.log" | head -8

for preset in qwen3-30b-a3b deepseek-v3; do
  timeout 35 python3 -m cupymoe bench --preset "$preset" --tokens 64 1024 4096 --lora 4 --lora-rank 16 --no-peers \
    --repeats 5 --replays 10 --json "${log}_${preset%%-*}.json" > "${log}_${preset%%-*}.log" 2>&1
  echo "bench $preset rc $?"; grep "N=" "${log}_${preset%%-*}.log"
done
