#!/usr/bin/env bash
# decode_wgmma_*_a8 with the rows' group scales copied with each ring stage (two blocks an SM at
# any K) against an older tree, in one device call: the GPU tests of the w8a8 decode kernels,
# then `bench` of the fp8 cells the table sends to decode/wgmma, the two trees alternating
# (scripts/ab_bench.sh, ROUNDS rounds), then decode/wgmma forced at FORCED_TOKENS on the
# FORCED preset in both trees. Logs and JSON as $OUT/run.tgz.
#
#   OUT=/tmp/out bash scripts/a8_stage_scales_check.sh   (OLD, default .old: the older tree, carried;
#   TESTS=0 skips the tests; PRESETS / TOKENS pick the A/B cells; ROUNDS, default 2;
#   FORCED / FORCED_TOKENS, default mixtral-8x7b / "64 128 256", FORCED_TOKENS="" skips them)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
ROOT=$PWD
OLD=${OLD:-.old}
W=$(mktemp -d)
trap 'tar czf "$DEST/run.tgz" -C "$W" .' EXIT
t0=$(date +%s)
[ "${TESTS:-1}" = 1 ] && PYTHONPATH=$ROOT bash scripts/gpu_tests.sh "$W" "down_tiles or w8a8_decode"
PRESETS=${PRESETS:-mixtral-8x7b qwen3-30b-a3b qwen3-235b-a22b}
TOKENS=${TOKENS:-16 32 64 128}
mkdir -p "$W/ab"
OUT=$W/ab A=$OLD B=$ROOT NAMES="old new" ROUNDS=${ROUNDS:-2} bash scripts/ab_bench.sh \
  --format fp8_block --preset $PRESETS --tokens $TOKENS
tar xzf "$W/ab/ab.tgz" -C "$W/ab" && rm "$W/ab/ab.tgz"
echo "A/B done ($(( $(date +%s) - t0 )) s)"
if [ -n "${FORCED_TOKENS-64 128 256}" ]; then
  export CUPYMOE_W8A8_DECODE=wgmma CUPYMOE_DECODE_KERNEL=register
  for pair in "old:$OLD" "new:$ROOT"; do
    name=${pair%%:*} t=${pair#*:}
    PYTHONPATH=$t timeout 200 python3 -P -m cupymoe bench --no-peers --format fp8_block --path decode \
      --decode-max-tokens 512 --preset ${FORCED:-mixtral-8x7b} --tokens ${FORCED_TOKENS-64 128 256} \
      --json "$W/forced-$name.json" > "$W/forced-$name.log" 2>&1
    echo "forced decode/wgmma $name rc $? ($(( $(date +%s) - t0 )) s)"
    grep -E " N=" "$W/forced-$name.log" | cut -c1-100
  done
fi
