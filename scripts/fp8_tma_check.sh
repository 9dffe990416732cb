#!/usr/bin/env bash
# The w8a8 TMA grouped GEMM's GPU check in one command (issue 40, benchmarks/DECISIONS.md "w8a8
# grouped GEMM by TMA"): its GPU tests (tests/test_gpu_fp8_tma.py: the reference stage by stage,
# the cp.async kernel's bits, skewed routing, graph replay), then qwen3-30b-a3b fp8_block at
# N = 256..16384 and deepseek-v3 at 1024 and 4096 timed with CUPYMOE_SM90_FP8_VARIANT=tma and
# with cp_async (today's kernel), then a table of the two. Logs and JSON under $OUT; < 4 minutes.
#
#   OUT=/tmp/out bash scripts/fp8_tma_check.sh
#   OUT=/tmp/out PARTS="bench" bash scripts/fp8_tma_check.sh      (skip the tests)
set -u
PARTS=${PARTS:-"tests bench"}
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
OUT=${OUT:?set OUT to a folder for the logs}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
COMMON=(--format fp8_block --no-peers --repeats 5 --replays 10)

if want tests; then
  # the first call compiles the kernels (about a minute on a fresh machine; cached for the benches)
  timeout 100 $PY -m pytest -q -m gpu tests/test_gpu_fp8_tma.py -p no:cacheprovider > "$OUT/fp8_tma_tests.log" 2>&1
  echo "fp8 TMA GPU tests rc $?: $(tail -1 "$OUT/fp8_tma_tests.log")"
  grep -E "FAILED|ERROR|Error" "$OUT/fp8_tma_tests.log" | head -8
fi
if want bench; then
  for v in tma cp_async; do
    rm -f "$OUT/qwen3_$v.json" "$OUT/deepseek_$v.json"  # a failed run leaves no figures of an earlier one
    CUPYMOE_SM90_FP8_VARIANT=$v timeout 40 $PY -m cupymoe bench --preset qwen3-30b-a3b --tokens 256 1024 4096 16384 \
      "${COMMON[@]}" --json "$OUT/qwen3_$v.json" > "$OUT/bench_qwen3_$v.log" 2>&1
    echo "bench qwen3-30b-a3b $v rc $?"
    CUPYMOE_SM90_FP8_VARIANT=$v timeout 50 $PY -m cupymoe bench --preset deepseek-v3 --tokens 1024 4096 \
      "${COMMON[@]}" --json "$OUT/deepseek_$v.json" > "$OUT/bench_deepseek_$v.log" 2>&1
    echo "bench deepseek-v3 $v rc $?"
  done
  $PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def rows(variant):
    found = {}
    for name in (f"qwen3_{variant}.json", f"deepseek_{variant}.json"):
        p = out / name
        if p.exists():
            found.update({(r["shape"], r["N"]): r for r in json.loads(p.read_text())["rows"]})
    return found
tma, cpa = rows("tma"), rows("cp_async")
# % fp8 floor: the routed experts' FLOPs at the fp8 rate (target >= 60); vLLM-fp8: its fp8 GEMMs
# alone over ours (target >= 1.6)
print(f"{'preset':<16}{'N':>6}  {'cp_async us':>11} {'tma us':>9} {'speedup':>8} {'% fp8 floor':>11} {'vLLM-fp8':>9}")
for key in sorted(set(tma) | set(cpa)):
    a, b = cpa.get(key), tma.get(key)
    fa = f"{a['us']:11.1f}" if a else f"{'-':>11}"
    fb = f"{b['us']:9.1f}" if b else f"{'-':>9}"
    sp = f"{a['us'] / b['us']:8.3f}" if a and b else f"{'-':>8}"
    fl = f"{b.get('pct_of_fp8_floor', float('nan')):11.1f}" if b else f"{'-':>11}"
    vl = f"{b['vllm_fp8_gemms_only'] / b['us']:9.2f}" if b and b.get("vllm_fp8_gemms_only") else f"{'-':>9}"
    print(f"{key[0]:<16}{key[1]:>6}  {fa} {fb} {sp} {fl} {vl}")
EOF
fi
