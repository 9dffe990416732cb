#!/usr/bin/env bash
# Nsight Compute of the w8a8 wgmma decode's two kernels and vLLM's two fp8 fused_moe_kernel launches
# at one cell (PRESET, TOKENS; default qwen3-30b-a3b fp8 16 rows): speed of light, memory workload,
# occupancy, warp states and launch statistics of each, as CSV in $OUT (ours.csv, vllm.csv); with
# STALLS=1 also each stall reason's cycles an issued instruction (smsp__average_warps_issue_stalled_*).
#
#   OUT=/tmp/out bash scripts/fp8_small_n_profile.sh    (.peer/ carried; PRESET, TOKENS, STALLS)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PEER_DIR=${PEER_DIR:-$PWD/.peer}
NCU="/usr/local/cuda/bin/ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section LaunchStats --csv --page details"
[ "${STALLS:-0}" = 1 ] && NCU="$NCU --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
PRESET=${PRESET:-qwen3-30b-a3b} TOKENS=${TOKENS:-16}
timeout 150 $NCU -k regex:decode_wgmma -c 2 python3 scripts/stage_times.py --preset "$PRESET" --format fp8_block \
  --tokens "$TOKENS" --reps 1 > "$DEST/ours.csv" 2> "$DEST/ours.err"
echo "ours rc $?"
(cd "$DEST" && FP8_SHAPES=$PRESET FP8_TOKENS=$TOKENS OUT=$(mktemp -d) timeout 150 $NCU -k regex:fused_moe -c 2 \
  python3 "$PEER_DIR/peer_bench_fp8.py" > "$DEST/vllm.csv" 2> "$DEST/vllm.err")
echo "vllm rc $?"
