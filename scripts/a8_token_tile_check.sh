#!/usr/bin/env bash
# The w8a8 wgmma decode's token tile as a tuned choice, in one device call: its GPU tests, vLLM's fp8
# GEMMs (PEER_SHAPES x PEER_TOKENS, .peer/ carried), then `python -m cupymoe tune --format fp8_block`
# of each CELLS entry ("preset:N,N,..", space-separated), whose sweep now times each wgmma token tile
# wider than the rule's. Logs and JSON straight into $OUT (tune-<preset>.json, peer_fp8.json: each there as
# soon as written, so a call cut short keeps what ran).
#
#   OUT=/tmp/out bash scripts/a8_token_tile_check.sh   (TESTS=0 skips the tests)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PEER_DIR=${PEER_DIR:-$PWD/.peer}
W=$DEST
t0=$(date +%s)
[ "${TESTS:-1}" = 1 ] && bash scripts/gpu_tests.sh "$W" "tuned_token_tile or w8a8_decode_kernels_by_knob"
PEER_SHAPES=${PEER_SHAPES:-qwen3-30b-a3b,qwen3-235b-a22b,mixtral-8x7b,qwen3-next-80b}
PEER_TOKENS=${PEER_TOKENS:-16,32,64,128,256}
if [ -n "$PEER_SHAPES" ]; then
  (cd "$W" && OUT=$W FP8_SHAPES=$PEER_SHAPES FP8_TOKENS=$PEER_TOKENS timeout 150 \
    python3 "$PEER_DIR/peer_bench_fp8.py" > "$W/peer_fp8.log" 2>&1)
  echo "vLLM fp8 rc $? ($(( $(date +%s) - t0 )) s)"
fi
CELLS=${CELLS:-"qwen3-30b-a3b:32,64,128 qwen3-235b-a22b:32,64,128 mixtral-8x7b:16,32 qwen3-next-80b:128,256"}
for cell in $CELLS; do
  preset=${cell%%:*} tokens=${cell#*:}
  timeout 200 python3 -P -m cupymoe tune --preset "$preset" --format fp8_block --tokens ${tokens//,/ } \
    --json "$W/tune-$preset.json" > "$W/tune-$preset.log" 2>&1
  echo "tune $preset rc $? ($(( $(date +%s) - t0 )) s)"
  grep -E "^  N=" "$W/tune-$preset.log" | cut -c1-170
done
