#!/usr/bin/env bash
# Issue 39's fp8 cells at 128-256 rows with every w8a8 decode kernel among the candidates
# (tune.DECODE_CAP: decode/mma and decode/wgmma up to 256 rows, beside the swap-AB decode and
# the prefill GEMMs), in one device call, under 6 minutes:
#   1. tests/test_gpu_quant.py::test_w8a8_decode_kernels_past_64_rows (N = 65, 129, 255 on both
#      kernels against the reference: the rows the table and the sweep send them);
#   2. vLLM's fp8 GEMMs for qwen3-30b-a3b and deepseek-v3 at 128 and 256 rows (needs .peer/, as
#      scripts/serving_check.sh);
#   3. `python -m cupymoe tune` of the five fp8 presets at 128 and 256 rows, then the table
#      (apply with `python -m cupymoe tune --apply $OUT/tune_fp8_decode.json`).
#
#   OUT=/tmp/out bash scripts/fp8_decode_check.sh
set -u
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PEER_DIR=${PEER_DIR:-$PWD/.peer}
mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu_quant.py -k past_64_rows \
  > "$OUT/fp8_decode_tests.log" 2>&1
echo "w8a8 decode past 64 rows rc $?: $(tail -1 "$OUT/fp8_decode_tests.log")"
(cd "$OUT" && OUT=$OUT FP8_SHAPES=qwen3-30b-a3b,deepseek-v3 FP8_TOKENS=128,256 timeout 90 \
  python3 "$PEER_DIR/peer_bench_fp8.py" > "$OUT/peer_fp8.log" 2>&1)
echo "vLLM fp8 rc $?"
timeout 240 python3 -m cupymoe tune --preset qwen3-30b-a3b qwen3-235b-a22b mixtral-8x7b deepseek-v3 qwen3-next-80b \
  --format fp8_block --tokens 128 256 --json "$OUT/tune_fp8_decode.json" > "$OUT/tune.log" 2>&1
echo "tune rc $?"
python3 scripts/serving_table.py "$OUT/tune_fp8_decode.json" --peers "$OUT/peer_fp8.json" | tee "$OUT/table.md" | tail -14
