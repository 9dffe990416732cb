#!/usr/bin/env bash
# The swap-AB bf16 decode's GPU check in one command (issue 39, benchmarks/DECISIONS.md "Next
# for #39"): its GPU tests, then qwen3-30b-a3b and mixtral-8x7b bf16 at N = 16..256 timed with
# CUPYMOE_DECODE_KERNEL=swapab (the decode path up to 256 rows on the swap-AB kernels) and
# without it (today's dispatch), then a table of the two. Logs and JSON under $OUT.
#
#   OUT=/tmp/out bash scripts/swapab_check.sh
#   OUT=/tmp/out PARTS="bench" bash scripts/swapab_check.sh      (skip the tests)
#   REGISTER=1: also the register decode forced to 256 rows (--path decode), for reference
set -u
PARTS=${PARTS:-"tests bench"}
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
OUT=${OUT:?set OUT to a folder for the logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOKENS="16 32 64 128 256"
BENCH=(-m cupymoe bench --preset qwen3-30b-a3b mixtral-8x7b --format bf16 --tokens $TOKENS --no-peers
       --repeats 5 --replays 20)

if want tests; then
  # the first call compiles the kernels (minutes on a fresh machine; cached for the benches)
  timeout 270 $PY -m pytest -q -m gpu tests/test_gpu_swapab.py -p no:cacheprovider > "$OUT/swapab_tests.log" 2>&1
  echo "swap-AB GPU tests rc $?: $(tail -1 "$OUT/swapab_tests.log")"
  grep -E "FAILED|ERROR|Error" "$OUT/swapab_tests.log" | head -8
fi
if want bench; then
  CUPYMOE_DECODE_KERNEL=swapab timeout 120 $PY "${BENCH[@]}" --json "$OUT/swapab_on.json" > "$OUT/bench_on.log" 2>&1
  echo "bench swapab rc $?"
  timeout 120 $PY "${BENCH[@]}" --json "$OUT/swapab_off.json" > "$OUT/bench_off.log" 2>&1
  echo "bench default rc $?"
  if [ "${REGISTER:-0}" = 1 ]; then
    CUPYMOE_DECODE_KERNEL=register timeout 120 $PY "${BENCH[@]}" --path decode --decode-max-tokens 256 \
      --json "$OUT/swapab_register.json" > "$OUT/bench_register.log" 2>&1
    echo "bench register decode rc $?"
  fi
  $PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(name):
    p = out / name
    return {(r["shape"], r["N"]): r for r in json.loads(p.read_text())["rows"]} if p.exists() else {}
on, off, reg = rows("swapab_on.json"), rows("swapab_off.json"), rows("swapab_register.json")
print(f"{'preset':<16}{'N':>5}  {'default us':>11} {'asked':<8} {'swapab us':>10} {'% floor':>8} {'speedup':>8}"
      + ("  register-decode us" if reg else ""))
for key in sorted(set(on) | set(off)):
    a, b = off.get(key), on.get(key)
    fa = f"{a['us']:11.1f} {a.get('path', '?'):<8}" if a else f"{'-':>11} {'':<8}"
    fb = f"{b['us']:10.1f} {b['pct_of_floor']:8.1f}" if b else f"{'-':>10} {'':>8}"
    sp = f"{a['us'] / b['us']:8.3f}" if a and b else f"{'-':>8}"
    extra = f"  {reg[key]['us']:.1f}" if key in reg else ""
    print(f"{key[0]:<16}{key[1]:>5}  {fa} {fb} {sp}{extra}")
EOF
fi
