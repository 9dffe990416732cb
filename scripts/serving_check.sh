#!/usr/bin/env bash
# Issue 39's measurement in one device call: vLLM timed beside us, then the tune sweep, then the table.
#   1. vLLM's compute-only bf16 time and its fp8 GEMMs (the shared peers' peer_bench.py /
#      peer_bench_fp8.py) for PEER_PRESETS at N = 16-2048;
#   2. `python -m cupymoe tune` of PRESETS in bf16 and fp8_block at the same N (apply its rows
#      here with `python -m cupymoe tune --apply FILE`);
#   3. scripts/serving_table.py over both: each cell's plan, µs, x floor and vs vLLM.
# Needs .peer/ (ignored, carried to the GPU machine): vllm_kernel.py and configs/ from the shared
# get_vllm_kernel.sh, and peer_bench.py, peer_bench_fp8.py copied beside them (scripts/device_setup.sh makes it).
#
# LIMIT (seconds, default 560) bounds the whole call: each peer run gets PEER_S (default 120) and
# the tune what is left (`tune --time-limit`: no cell starts past it, the cells left are listed as
# skipped in its result; PRESETS' order is the order they are timed in).
#
#   OUT=/tmp/out bash scripts/serving_check.sh
#   OUT=/tmp/out LIMIT=400 PRESETS="qwen3-30b-a3b" PEER_PRESETS="qwen3-30b-a3b" bash scripts/serving_check.sh
#   OUT=/tmp/out FORMATS=fp8_block bash scripts/serving_check.sh     (one format: the other's peer run left out)
set -u
t0=$(date +%s)
left() { echo $(( ${LIMIT:-560} - ($(date +%s) - t0) )); }
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PEER_DIR=${PEER_DIR:-$PWD/.peer}
PRESETS=${PRESETS:-"qwen3-30b-a3b deepseek-v3 mixtral-8x7b qwen3-next-80b qwen3-235b-a22b gpt-oss-120b"}
PEER_PRESETS=${PEER_PRESETS:-"qwen3-30b-a3b deepseek-v3"}
T=${TOKENS:-"16 32 64 128 256 512 1024 2048"}
FORMATS=${FORMATS:-"bf16 fp8_block"}
mkdir -p "$OUT"
shapes=${PEER_PRESETS// /,}
if [[ " $FORMATS " == *" bf16 "* ]]; then
  (cd "$OUT" && OUT=$OUT timeout "${PEER_S:-120}" python3 "$PEER_DIR/peer_bench.py" --shapes "$shapes" \
    --tokens "${T// /,}" --impls vllm_compute_only > "$OUT/peer.log" 2>&1)
  echo "vLLM bf16 rc $? ($(left) s left)"
fi
# peer_bench_fp8.py quantizes in 128 x 128 blocks: gpt-oss-120b's I = 2880 is not a multiple of 128
# (it raised for the whole run), so vLLM's fp8 GEMMs leave it out
fp8_shapes=$(echo "$PEER_PRESETS" | tr ' ' '\n' | grep -vx gpt-oss-120b | paste -sd, -)
if [[ " $FORMATS " == *" fp8_block "* ]]; then
  (cd "$OUT" && OUT=$OUT FP8_SHAPES=$fp8_shapes FP8_TOKENS=${T// /,} timeout "${PEER_S:-120}" \
    python3 "$PEER_DIR/peer_bench_fp8.py" > "$OUT/peer_fp8.log" 2>&1)
  echo "vLLM fp8 rc $? ($(left) s left)"
fi
# the tune stops starting cells ~40 s before the limit (a cell takes up to ~20 s), the timeout is the backstop
tune_s=$(( $(left) - 40 ))
if [ "$tune_s" -gt 20 ]; then
  timeout $(( tune_s + 30 )) python3 -m cupymoe tune --preset $PRESETS --format $FORMATS --tokens $T \
    --time-limit "$tune_s" --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  echo "tune rc $? ($(left) s left)"
else
  echo "tune not run: $(left) s left of LIMIT"
fi
peers=$(ls "$OUT/peer.json" "$OUT/peer_fp8.json" 2>/dev/null)  # a peer run that failed (e.g. out of memory) left none
python3 scripts/serving_table.py "$OUT/tune.json" --peers $peers | tee "$OUT/table.md" | tail -30
