#!/usr/bin/env bash
# The swap-AB w8a8 decode's GPU check in one command (issue 39, benchmarks/DECISIONS.md "Swap-AB
# w8a8 decode"): its GPU tests (tests/test_gpu_swapab_fp8.py, then the bf16 ones it shares
# dispatch and maps with), then the tune sweep of qwen3-30b-a3b and deepseek-v3 fp8_block (w8a8)
# at N = 16..512 with the swap-AB candidate up to 256 rows, then a table of each cell's default
# and swap-AB times. Logs, the result file and a tuning table with its rows under $OUT.
#
#   OUT=/tmp/out bash scripts/swapab_fp8_check.sh
#   OUT=/tmp/out PARTS="tune" bash scripts/swapab_fp8_check.sh      (skip the tests)
set -u
PARTS=${PARTS:-"tests tune"}
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
OUT=${OUT:?set OUT to a folder for the logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

if want tests; then
  # the first call compiles the kernels (a minute or two on a fresh machine; cached for the sweep)
  timeout 200 $PY -m pytest -q -m gpu tests/test_gpu_swapab_fp8.py tests/test_gpu_swapab.py -p no:cacheprovider \
    > "$OUT/swapab_fp8_tests.log" 2>&1
  echo "swap-AB GPU tests rc $?: $(tail -1 "$OUT/swapab_fp8_tests.log")"
  grep -E "FAILED|ERROR|Error" "$OUT/swapab_fp8_tests.log" | head -8
fi
if want tune; then
  timeout 300 $PY -m cupymoe tune --preset qwen3-30b-a3b deepseek-v3 --format fp8_block \
    --tokens 16 32 64 128 256 512 --json "$OUT/tune_fp8.json" --table-out "$OUT/tuning_fp8.json" \
    > "$OUT/tune_fp8.log" 2>&1
  echo "tune rc $?"
  grep -E "^\s+N=|skipped|Error" "$OUT/tune_fp8.log" | head -20
  $PY - "$OUT/tune_fp8.json" <<'PYEOF'
import json, sys
from pathlib import Path

p = Path(sys.argv[1])
if not p.exists():
    sys.exit("no result file")
cells = json.loads(p.read_text())["cells"]
# rel_err: the swap-AB output's normwise distance from the default's (tune drops a candidate past 0.05)
print(f"{'preset':<16}{'N':>5}  {'default':<14}{'us':>8}  {'swapab us':>9} {'% floor':>8} {'rel_err':>8}  "
      f"{'chosen':<16}{'speedup':>8}")
for c in cells:
    sw = [t for t in c["candidates"] if t.get("decode_kernel") == "swapab" and t["path"] == "decode"]
    s = (f"{sw[0]['us']:9.1f} {sw[0]['pct_of_floor']:8.1f} {sw[0]['rel_err']:8.4f}" if sw
         else f"{'-':>9} {'':>8} {'':>8}")
    d = c["default"]
    print(f"{c['shape']:<16}{c['N']:>5}  {d['label']:<14}{d['us']:8.1f}  {s}  {c['chosen']['label']:<16}"
          f"{c['speedup']:8.3f}")
PYEOF
fi
