#!/usr/bin/env bash
# Issue 40's measurement in one device call: vLLM timed beside us at N >= 4096, then our layer, then the table.
#   1. vLLM's compute-only bf16 time (the shared peers' peer_bench.py) for BF16_PRESETS and its fp8 GEMMs
#      (peer_bench_fp8.py) for FP8_PEER_PRESETS (default FP8_PRESETS; on an 80 GB card leave deepseek-v3 out:
#      its quantization runs out of memory and takes the whole peer run down), at TOKENS (default 4096 16384);
#   2. `python -m cupymoe bench --no-peers` of the same presets and formats, the table's plans;
#   3. scripts/prefill_table.py over both: each cell's µs, % of its floor and vs vLLM against issue 40's bars.
# Needs .peer/ (scripts/device_setup.sh). PEER_S bounds each peer run (default 150 s), BENCH_S each
# preset's bench (default 120 s).
#
#   OUT=/tmp/out bash scripts/prefill_check.sh
#   OUT=/tmp/out FORMATS=bf16 BF16_PRESETS="mixtral-8x7b deepseek-v3" bash scripts/prefill_check.sh
set -u
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PEER_DIR=${PEER_DIR:-$PWD/.peer}
BF16_PRESETS=${BF16_PRESETS:-"qwen3-30b-a3b qwen3-next-80b deepseek-v3 mixtral-8x7b qwen3-235b-a22b gpt-oss-120b"}
FP8_PRESETS=${FP8_PRESETS:-"qwen3-30b-a3b deepseek-v3 qwen3-235b-a22b mixtral-8x7b"}
T=${TOKENS:-"4096 16384"}
FORMATS=${FORMATS:-"bf16 fp8_block"}
mkdir -p "$OUT"
# one bench process a preset: a timeout or a failure costs that preset alone
bench() {
  local fmt=$1; shift
  for p in "$@"; do
    timeout "${BENCH_S:-120}" python3 -m cupymoe bench --no-peers --preset "$p" --format "$fmt" --tokens $T \
      --json "$OUT/bench_${fmt}_$p.json" > "$OUT/bench_${fmt}_$p.log" 2>&1
    echo "bench $fmt $p rc $?"
  done
}
peers=()
if [[ " $FORMATS " == *" bf16 "* ]]; then
  b=${BF16_PRESETS// /,}
  (cd "$OUT" && OUT=$OUT timeout "${PEER_S:-150}" python3 "$PEER_DIR/peer_bench.py" --shapes "$b" \
    --tokens "${T// /,}" --impls vllm_compute_only > "$OUT/peer.log" 2>&1)
  echo "vLLM bf16 rc $?"
  bench bf16 $BF16_PRESETS
  peers+=("$OUT/peer.json")
fi
if [[ " $FORMATS " == *" fp8_block "* ]]; then
  shapes=$(echo ${FP8_PEER_PRESETS:-$FP8_PRESETS} | tr ' ' ,)
  (cd "$OUT" && OUT=$OUT FP8_SHAPES=$shapes FP8_TOKENS=${T// /,} timeout "${PEER_S:-150}" \
    python3 "$PEER_DIR/peer_bench_fp8.py" > "$OUT/peer_fp8.log" 2>&1)
  echo "vLLM fp8 rc $?"
  bench fp8_block $FP8_PRESETS
  peers+=("$OUT/peer_fp8.json")
fi
have=()  # a peer run that failed left no file
for p in "${peers[@]}"; do [ -f "$p" ] && have+=("$p"); done
python3 scripts/prefill_table.py "$OUT"/bench_*.json --peers "${have[@]}" | tee "$OUT/table.md"
