#!/usr/bin/env bash
# The measurement behind kernels.GATHER_MAX_INTERMEDIATE and the auto variants (benchmarks/DECISIONS.md): the six bf16 shapes at
# prefill sizes under each Hopper GEMM variant (CUPYMOE_SM90_VARIANT), one process per
# (variant, shape), stage times included. Logs and JSON come back as $OUT/run.tgz.
#
#   OUT=/tmp/out bash scripts/sm90_variants.sh
#   OUT=/tmp/out VARIANTS="twin tma" TOKENS="4096 16384" bash scripts/sm90_variants.sh
set -u
D=$(mktemp -d); trap 'tar czf $OUT/run.tgz -C $D .' EXIT
for v in ${VARIANTS:-twin tma_wide gather_wide}; do
  for p in qwen3-30b-a3b qwen3-235b-a22b deepseek-v3 mixtral-8x7b qwen3-next-80b gpt-oss-120b; do
    CUPYMOE_SM90_VARIANT=$v timeout 100 python3 -m cupymoe bench --preset $p --tokens ${TOKENS:-1024 4096 16384} \
      --repeats 3 --replays 5 --no-peers --stages --json $D/grid-$v-$p.json > $D/grid-$v-$p.log 2>&1
    echo "== $v $p rc $?"; grep -E "N=|stages" $D/grid-$v-$p.log | sed 's/  */ /g' | cut -c1-120
  done
done
