#!/usr/bin/env bash
# Several source trees timed against each other in one device call: the w8a8 decode GPU tests in each
# (TEST_K, empty: none), then `bench` of each tree in turn, ROUNDS rounds (trees: folders holding
# cupymoe/ and cuda/, carried; TREES="name:folder ..."). Modules whose sources agree between trees
# share the kernel cache, so a tree costs only its own changed modules' compiles. Logs and JSON
# straight into $OUT.
#
#   OUT=/tmp/out TREES="main:.old a:.va b:." bash scripts/trees_bench.sh --format fp8_block --preset qwen3-30b-a3b --tokens 16
set -u
DEST=${OUT:?set OUT to a folder for the results}
TREES=${TREES:?TREES: name:folder pairs}
t0=$(date +%s)
for pair in $TREES; do
  name=${pair%%:*} t=${pair#*:}
  if [ -n "${TEST_K-down_tiles or w8a8_decode_kernels_by_knob}" ]; then
    PYTHONPATH=$t timeout 200 python3 -P -m pytest -q -m gpu -p no:cacheprovider -rf tests/test_gpu_quant.py \
      -k "${TEST_K-down_tiles or w8a8_decode_kernels_by_knob}" > "$DEST/tests-$name.log" 2>&1
    echo "tests $name rc $? ($(( $(date +%s) - t0 )) s): $(tail -1 "$DEST/tests-$name.log")"
    grep -E "^FAILED|^ERROR" "$DEST/tests-$name.log" | head -3
  fi
done
for round in $(seq 1 "${ROUNDS:-1}"); do
  for pair in $TREES; do
    name=${pair%%:*} t=${pair#*:}
    PYTHONPATH=$t timeout 200 python3 -P -m cupymoe bench --no-peers "$@" --json "$DEST/$name-$round.json" \
      > "$DEST/$name-$round.log" 2>&1
    echo "$name round $round ($(( $(date +%s) - t0 )) s):"; grep -E " N=" "$DEST/$name-$round.log" | cut -c1-100
  done
done
