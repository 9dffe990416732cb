#!/usr/bin/env bash
# decode_wgmma_down_a8 with T 128-row tiles a block through one ring (CUPYMOE_A8_DOWN_TILES), in
# one device call: the GPU tests of the w8a8 decode kernels (T = 2, 3, 4 and the knob-picked
# kernels at T = 1), then `bench` of the fp8 cells the table sends to decode/wgmma at 16-128 rows
# with T = 1, 2, 4 and the layer's rule (auto) in turn, ROUNDS rounds (the cells on other
# kernels stay as controls); PEERS=1 first times vLLM's fp8 GEMMs on those presets (.peer/,
# carried). Logs and JSON as $OUT/run.tgz.
#
#   OUT=/tmp/out bash scripts/a8_down_tiles_check.sh     (ROUNDS, default 1; TILES, default "1 2 4 auto";
#   TESTS=0 skips the tests; PRESETS / TOKENS pick the cells)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH=$ROOT PEER_DIR=${PEER_DIR:-$ROOT/.peer}
W=$(mktemp -d)
trap 'tar czf "$DEST/run.tgz" -C "$W" .' EXIT
t0=$(date +%s)
[ "${TESTS:-1}" = 1 ] && bash scripts/gpu_tests.sh "$W" "down_tiles or w8a8_decode_kernels"
PRESETS=${PRESETS:-qwen3-30b-a3b qwen3-next-80b qwen3-235b-a22b mixtral-8x7b}
TOKENS=${TOKENS:-16 32 64 128}
if [ "${PEERS:-0}" = 1 ]; then
  (cd "$W" && OUT=$W FP8_SHAPES=$(echo $PRESETS | tr ' ' ,) FP8_TOKENS=$(echo $TOKENS | tr ' ' ,) timeout 150 \
    python3 "$PEER_DIR/peer_bench_fp8.py" > "$W/peer_fp8.log" 2>&1)
  echo "vLLM fp8 rc $? ($(( $(date +%s) - t0 )) s)"
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for t in ${TILES:-1 2 4 auto}; do
    if [ "$t" = auto ]; then unset CUPYMOE_A8_DOWN_TILES; else export CUPYMOE_A8_DOWN_TILES=$t; fi
    timeout 240 python3 -P -m cupymoe bench --no-peers --format fp8_block \
      --preset $PRESETS --tokens $TOKENS --json "$W/tiles$t-r$round.json" > "$W/tiles$t-r$round.log" 2>&1
    echo "T=$t round $round rc $? ($(( $(date +%s) - t0 )) s)"
    grep -E " N=" "$W/tiles$t-r$round.log" | cut -c1-100
  done
done
