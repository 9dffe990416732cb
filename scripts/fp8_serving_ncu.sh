#!/usr/bin/env bash
# Nsight Compute of the fp8 (w8a8) GEMM kernels of qwen3-30b-a3b at TOKENS (default 256 512), ours (the plan
# the GPU takes) and vLLM's fused_moe_kernel (.peer/ carried: the shared peers), raw metrics as CSV in one tarball:
# time, DRAM bytes and % of peak, L2 and SM %, occupancy, issue %, and each stall reason's cycles an issued instruction.
#
#   OUT=/tmp/out TOKENS="256 512" bash scripts/fp8_serving_ncu.sh
#   OUT=/tmp/out TOKENS=512 VLLM=0 TAG=tma64 FORM="CUPYMOE_SM90_FP8_VARIANT=tma64" ARGS="--path prefill" bash scripts/fp8_serving_ncu.sh
# FORM (environment settings) and ARGS (scripts/stage_times.py's) force one of our forms; TAG names its files.
# Each run's CSV as JSON, a launch each: python scripts/ncu_launches.py TAG-N.csv ... (from the tarball).
set -u
OUT=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
python3 -m pip install -q .whl/nvtx*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD PEER_DIR=$PWD/.peer
source scripts/kernel_cache_env.sh >/dev/null
echo "gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_misc_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active"
NCU="/usr/local/cuda/bin/ncu --clock-control none --metrics $M --csv --page raw"
for T in ${TOKENS:-256 512}; do
  env ${FORM:-} timeout 120 $NCU -k regex:"grouped_gemm_sm90_fp8|decode_wgmma|decode_swapab" -c 4 python3 scripts/stage_times.py \
    --preset qwen3-30b-a3b --format fp8_block --tokens $T --reps 1 ${ARGS:-} > $OUT/${TAG:-ours}-$T.csv 2> $OUT/${TAG:-ours}-$T.err
  echo "${TAG:-ours} $T rc $?"
  if [ "${VLLM:-1}" = 1 ]; then
    (cd $OUT && FP8_SHAPES=qwen3-30b-a3b FP8_TOKENS=$T OUT=$(mktemp -d) timeout 120 $NCU -k regex:fused_moe -c 4 \
      python3 $PEER_DIR/peer_bench_fp8.py > $OUT/vllm-$T.csv 2> $OUT/vllm-$T.err); echo "vllm $T rc $?"
  fi
done
tar czf $OUT/${TAG:-ours}.tgz -C $OUT $(cd $OUT && ls *.csv *.err) && rm -f $OUT/*.csv $OUT/*.err
