#!/usr/bin/env bash
# decode_topk_lists (the routing and the expert lists in one launch) at 17-64 rows against main's
# two launches (topk_route, decode_build_lists), in one device call: the list builders' GPU test
# on this tree, then `bench` of this tree and main's exported into .old/ (carried; `git archive
# main cupymoe cuda | tar x -C .old`) in turn, ROUNDS rounds, bf16 and fp8_block. Logs and JSON
# as $OUT/run.tgz; the summary lines on stdout.
#
#   OUT=/tmp/out bash scripts/topk_lists_check.sh     (ROUNDS, default 2; PRESETS / TOKENS)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
W=$(mktemp -d)
trap 'tar czf "$DEST/run.tgz" -C "$W" .' EXIT
PYTHONPATH=$PWD bash scripts/gpu_tests.sh "$W" "route_lists_expert_lists" tests-lists tests/test_gpu_layer.py
PRESETS=${PRESETS:-qwen3-30b-a3b qwen3-235b-a22b mixtral-8x7b gpt-oss-120b}
TOKENS=${TOKENS:-24 32 48 64}
TEST_K= ROUNDS=${ROUNDS:-2} OUT=$W TREES="main:.old new:." bash scripts/trees_bench.sh --format bf16 fp8_block \
  --preset $PRESETS --tokens $TOKENS
