#!/usr/bin/env bash
# Several source trees timed against each other in one device call: the w8a8 decode GPU tests in each
# (TEST_K, empty: none), then `bench` of each tree in turn, ROUNDS rounds (trees: folders holding
# cupymoe/ and cuda/, carried; TREES="name:folder ...", or "name:folder:KNOB=V,KNOB=V" to run that tree
# under those environment knobs, so one tree can be timed against itself). Modules whose sources agree between trees
# share the kernel cache, so a tree costs only its own changed modules' compiles. Logs and JSON
# come back as $OUT/trees.tgz (the device tool returns few loose files); each bench line printed
# with its LoRA figure where there is one. TEST_FILES: the test files (default tests/test_gpu_quant.py).
#
#   OUT=/tmp/out TREES="main:.old a:.va b:." bash scripts/trees_bench.sh --format fp8_block --preset qwen3-30b-a3b --tokens 16
#   OUT=/tmp/out TREES="main:. bands:.:CUPYMOE_GEMM_BAND_COLS=8" bash scripts/trees_bench.sh --format fp8_block
set -u
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
OUTER=${OUT:?set OUT to a folder for the results}
TREES=${TREES:?TREES: name:folder pairs}
DEST=$(mktemp -d)
trap 'tar czf "$OUTER/trees.tgz" -C "$DEST" .' EXIT
t0=$(date +%s)
for pair in $TREES; do
  IFS=: read -r name t knobs <<< "$pair"
  if [ -n "${TEST_K-down_tiles or w8a8_decode_kernels_by_knob}" ]; then
    env ${knobs//,/ } PYTHONPATH=$t KERNELS=0 bash scripts/gpu_tests.sh "$DEST" "${TEST_K-down_tiles or w8a8_decode_kernels_by_knob}" "tests-$name" \
      ${TEST_FILES:-}
  fi
done
for round in $(seq 1 "${ROUNDS:-1}"); do
  for pair in $TREES; do
    IFS=: read -r name t knobs <<< "$pair"
    env ${knobs//,/ } PYTHONPATH=$t timeout "${BENCH_S:-300}" python3 -P -m cupymoe bench --no-peers "$@" --json "$DEST/$name-$round.json" \
      > "$DEST/$name-$round.log" 2>&1
    echo "$name round $round ($(( $(date +%s) - t0 )) s):"
    grep -E " N=" "$DEST/$name-$round.log" | sed -E 's/^(.{0,60} us).*(LoRA .*)$/\1  \2/' | cut -c1-140
  done
done
