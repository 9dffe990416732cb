#!/usr/bin/env bash
# A device script's targeted GPU tests: the kernels built first (`python -m cupymoe kernels`, skipped
# with KERNELS=0), then `pytest -m gpu -k EXPR` over the test files (default tests/test_gpu_quant.py;
# an empty EXPR: every GPU test of the files),
# both against the tree on PYTHONPATH; logs kernels.log and NAME.log into DEST; prints each exit
# status, pytest's summary line and the first failures. Exits with pytest's status.
#
#   bash scripts/gpu_tests.sh DEST "EXPR" [NAME [test file ...]]
set -u
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
DEST=${1:?DEST: a folder for the logs}; EXPR=${2?EXPR: a pytest -k expression (empty: every GPU test)}; NAME=${3:-tests}
shift $(( $# < 3 ? $# : 3 ))
t0=$(date +%s)
if [ "${KERNELS:-1}" = 1 ]; then
  timeout 200 python3 -P -m cupymoe kernels > "$DEST/kernels.log" 2>&1
  echo "kernels rc $? ($(( $(date +%s) - t0 )) s)"
fi
timeout "${TESTS_S:-300}" python3 -P -m pytest -q -m gpu -p no:cacheprovider -rfs "${@:-tests/test_gpu_quant.py}" \
  ${EXPR:+-k "$EXPR"} > "$DEST/$NAME.log" 2>&1
rc=$?
echo "$NAME rc $rc ($(( $(date +%s) - t0 )) s): $(tail -1 "$DEST/$NAME.log")"
grep -E "^FAILED|^ERROR" "$DEST/$NAME.log" | head -5
exit $rc
