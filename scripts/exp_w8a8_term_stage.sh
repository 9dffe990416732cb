#!/usr/bin/env bash
# exp/w8a8-term-stage: what this branch holds for a device run (not run on a GPU yet).
# check_w8a8 judges the stored weighted terms (yw) within one ulp of float64 fed the kernels'
# codes, and the output against the sum of the kernels' own terms. Runs: the GPU tests, the
# seed that failed (`verify --seed 105763336`), verify on fp8 with five fresh seeds, and many
# fresh fp8 draws (scripts/faithful_draws.py) for the rate of failures left.
set -u
D=$(mktemp -d); trap 'tar czf $OUT/run.tgz -C $D .' EXIT
timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider > $D/tests.log 2>&1
echo "tests rc $?: $(tail -1 $D/tests.log)"; grep -E "^(FAILED|ERROR)" $D/tests.log | head
timeout 60 python3 -m cupymoe verify --seed 105763336 > $D/verify-seed.log 2>&1; echo "seed rc $?: $(tail -1 $D/verify-seed.log)"
for i in 1 2 3 4 5; do timeout 40 python3 -m cupymoe verify --format fp8_block > $D/verify-fp8-$i.log 2>&1
  echo "fp8 verify $i rc $?: $(head -1 $D/verify-fp8-$i.log | cut -c1-40) $(tail -1 $D/verify-fp8-$i.log)"; grep FAIL $D/verify-fp8-$i.log | head -2; done
timeout 150 python3 scripts/faithful_draws.py collect --out $D/draws.npz --draws 8 --format fp8_block > $D/draws.log 2>&1
echo "draws rc $?"; cat $D/draws.log
