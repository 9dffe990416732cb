#!/usr/bin/env bash
# exp/fp8-decode-mma: what this branch holds for a device run (not run on a GPU yet).
#   1. correctness: the quantized GPU tests (fp8 decode now on tensor cores by default,
#      every K split, CUPYMOE_FP8_DECODE=cores against the reference too) and `verify`;
#   2. speed: fp8 decode on tensor cores against the CUDA-core readers at N = 1 .. 64 (path
#      forced to decode, decode_max_tokens 64), next to the grouped w8a8 path at 16 .. 64:
#      the data for fp8's decode_max_tokens (layer.DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT).
# Logs and JSON come back as $OUT/run.tgz.
set -u
D=$(mktemp -d); trap 'tar czf $OUT/run.tgz -C $D .' EXIT
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_quant.py tests/test_gpu_layer.py -p no:cacheprovider > $D/tests.log 2>&1
echo "tests rc $?: $(tail -1 $D/tests.log)"; grep -E "^(FAILED|ERROR)" $D/tests.log | head
timeout 60 python3 -m cupymoe verify --format fp8_block > $D/verify.log 2>&1; echo "verify rc $?: $(tail -1 $D/verify.log)"
for mode in mma cores; do
  CUPYMOE_FP8_DECODE=$mode timeout 90 python3 -m cupymoe bench --preset qwen3-30b-a3b deepseek-v3 --format fp8_block \
    --tokens 1 4 8 16 32 64 --path decode --decode-max-tokens 64 --repeats 5 --replays 10 --no-peers \
    --json $D/fp8-decode-$mode.json > $D/fp8-decode-$mode.log 2>&1
  echo "== fp8 decode $mode rc $?"; grep "N=" $D/fp8-decode-$mode.log | sed 's/  */ /g' | cut -c1-110
done
timeout 60 python3 -m cupymoe bench --preset qwen3-30b-a3b deepseek-v3 --format fp8_block --tokens 16 32 64 --path prefill \
  --repeats 5 --replays 10 --no-peers --json $D/fp8-prefill.json > $D/fp8-prefill.log 2>&1
echo "== fp8 prefill (w8a8) rc $?"; grep "N=" $D/fp8-prefill.log | sed 's/  */ /g' | cut -c1-110
