#!/usr/bin/env bash
# CUPYMOE_LORA_STACK_SHRINK (the stacked form's shrinks as chunks of one adapter, or as one dense GEMM
# a tile, lora_stack_t_gemm) in one device call: the stacked-form GPU tests of the gemm form and the
# graph / no-adapter ones, judged against the reference; then bench --lora at qwen3-30b-a3b bf16 and
# fp8_block (w8a16) 1024 / 4096 rows, the two forms alternating (ROUNDS), and deepseek-v3 once each.
# Logs and JSON as $OUT/run.tgz.
#
#   OUT=/tmp/out bash scripts/lora_shrink_gemm_check.sh    (.whl carried; ROUNDS, default 2; TESTS=0 skips them)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
pip install -q .whl/nvtx*.whl > /dev/null 2>&1
W=$(mktemp -d)
trap 'tar czf "$DEST/run.tgz" -C "$W" .' EXIT
t0=$(date +%s)
if [ "${TESTS:-1}" = 1 ]; then
  KERNELS=0 TESTS_S=260 bash scripts/gpu_tests.sh "$W" "stacked and (gemm or graph or without)" tests tests/test_gpu_lora.py
fi
bench() {  # preset format tokens shrink tag
  CUPYMOE_LORA_STACK_SHRINK=$4 timeout 150 python3 -P -m cupymoe bench --no-peers --preset "$1" --format "$2" \
    --tokens $3 --lora 4 --lora-rank 16 --repeats 7 --replays 10 --json "$W/$5.json" > "$W/$5.log" 2>&1
  echo "$5 ($(( $(date +%s) - t0 )) s): $(grep -E 'N=' "$W/$5.log" | grep -o 'N=[0-9]*\|LoRA.*' | tr '\n' ' ')"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for fmt in bf16 fp8_block; do
    for sh in chunks gemm; do bench qwen3-30b-a3b $fmt "1024 4096" $sh "qwen3-$fmt-$sh-$round"; done
  done
done
for fmt in bf16 fp8_block; do
  for sh in chunks gemm; do bench deepseek-v3 $fmt "1024 4096" $sh "deepseek-$fmt-$sh"; done
done
