#!/usr/bin/env bash
# The weight maps' L2 promotion (CUPYMOE_WEIGHT_L2_PROMOTION) in one device call: the GPU tests of
# the TMA kernels under `none`, then `bench` of the cells whose kernels read weights by TMA (bf16
# swap-AB decodes at 16-256 rows, the w8a8 TMA GEMM and swap-AB fp8, the bf16 TMA prefill GEMMs)
# and control cells that read none (qwen3-30b-a3b fp8 at 16-128: the register w8a8 decode), each
# setting in turn, PROMOS in round 1 and the first two of them again in round 2. JSON and logs come
# back as $OUT/promo.tgz, rewritten after each step.
#
#   OUT=/tmp/out bash scripts/l2_promotion_check.sh          (~8 minutes on a warm H200)
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
OUT=$(mktemp -d)
save() { tar czf "$DEST/promo.tgz" -C "$OUT" .; }
PROMOS=${PROMOS:-"256 none 128"}
timeout 120 python3 -P -m cupymoe kernels > "$OUT/kernels.log" 2>&1; echo "kernels rc $?"
CUPYMOE_WEIGHT_L2_PROMOTION=none CUPYMOE_TEST_SEED=1 timeout 150 python3 -P -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_gpu_swapab.py tests/test_gpu_fp8_tma.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests (none) rc $?: $(tail -1 "$OUT/gpu_tests.log")"
save
B="python3 -P -m cupymoe bench --no-peers --repeats 3 --replays 10"
run() {  # promo round name bench-args...
  local promo=$1 round=$2 name=$3; shift 3
  CUPYMOE_WEIGHT_L2_PROMOTION=$promo timeout 90 $B "$@" --json "$OUT/$name-$promo-$round.json" > "$OUT/$name-$promo-$round.log" 2>&1
  echo "$name $promo round $round rc $?"; grep -h "N=" "$OUT/$name-$promo-$round.log" | cut -c1-60
  save
}
for round in 1 2; do
  promos=$PROMOS; [ $round = 2 ] && promos=$(echo $PROMOS | cut -d' ' -f1-2)
  for promo in $promos; do
    run $promo $round q3 --preset qwen3-30b-a3b --format bf16 fp8_block --tokens 16 64 128 1024 4096
    run $promo $round big --preset qwen3-235b-a22b gpt-oss-120b --format bf16 --tokens 64 128 256
    if [ $round = 1 ]; then
      run $promo $round mix --preset mixtral-8x7b --format bf16 --tokens 16 32
      run $promo $round oss8 --preset gpt-oss-120b --format fp8_block --tokens 128 1024
    fi
  done
done
