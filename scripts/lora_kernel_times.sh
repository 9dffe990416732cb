#!/usr/bin/env bash
# The LoRA forward's kernels one by one under Nsight Compute (each alone, caches flushed: duration,
# DRAM bytes and throughput, registers, grid, L2 and SM throughput, achieved occupancy), base kernels
# included so each LoRA launch reads against them; then the forward on the graph timeline (what
# overlaps) at each of TOKENS. PRESET (default qwen3-30b-a3b), TOKENS (default "1 64"), FORMATS
# (default "bf16 fp8_block"; fp8_block as w8a16), 4 adapters of rank 16 (BASE=1: the base forward's
# kernels too, no adapters, so each LoRA GEMM reads against its base twin). A table a format on
# stdout; logs as $OUT/times.tgz.
#
#   OUT=/tmp/out bash scripts/lora_kernel_times.sh   (.whl carried)
. "$(dirname "$0")/lora_bench.sh"
W=$(mktemp -d)
trap 'tar czf "$DEST/times.tgz" -C "$W" .' EXIT
PRESET=${PRESET:-qwen3-30b-a3b}
TOKENS=${TOKENS:-1 64}
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
ADAPTERS=4  # rank 16; BASE=1: also none, the base forward's own kernels
[ "${BASE:-0}" = 1 ] && ADAPTERS="4 0"
for fmt in ${FORMATS:-bf16 fp8_block}; do
  for n in $TOKENS; do
    for k in $ADAPTERS; do
      tag=$fmt-$n-l$k
      # shellcheck disable=SC2086  # one token count a run: the table's rows are that count's kernels
      timeout 200 /usr/local/cuda/bin/ncu --clock-control none --csv --metrics $M python3 scripts/stage_times.py \
        --preset "$PRESET" --format "$fmt" --fp8-compute w8a16 --tokens $n --reps 3 --lora $k --lora-rank 16 \
        > "$W/ncu-$tag.csv" 2> "$W/ncu-$tag.err"
      echo "== $PRESET $fmt N=$n, $k adapters (ncu rc $?): kernel, us, DRAM MB read, % of DRAM peak, registers, blocks, % of L2 peak, % of SM peak, achieved occupancy % (medians of 3)"
      python3 scripts/ncu_kernel_table.py "$W/ncu-$tag.csv"
    done
    timeout 100 python3 -P scripts/graph_timeline.py --preset "$PRESET" --format "$fmt" --fp8-compute w8a16 \
      --tokens "$n" --lora 4 > "$W/timeline-$fmt-$n.log" 2>&1
    echo "-- timeline:"; grep -E "start|span" "$W/timeline-$fmt-$n.log"
  done
done
