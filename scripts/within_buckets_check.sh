#!/usr/bin/env bash
# The tuning table's plans inside its buckets (the sweeps time each bucket at its top only): `bench`
# with the packaged table, then with ALT (one KNOB=VALUE forcing the alternative), at TOKENS for
# PRESETS in FORMAT, on the same inputs; a line a cell with the table's time against ALT's.
# JSON and logs into OUT (within-table.json, within-alt.json).
#
#   OUT=/tmp/out bash scripts/within_buckets_check.sh
#   OUT=/tmp/out FORMAT=fp8_block ALT=CUPYMOE_W8A8_DECODE=mma bash scripts/within_buckets_check.sh
#   (defaults: FORMAT bf16, ALT CUPYMOE_DECODE_KERNEL=register, the six presets, TOKENS 9 11 13 17 21 25 33 41)
set -u
DEST=${OUT:?set OUT to a folder for the results}
cd "$(dirname "$0")/.."
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
export PYTHONPATH=$PWD
PRESETS=${PRESETS:-qwen3-30b-a3b qwen3-next-80b qwen3-235b-a22b mixtral-8x7b gpt-oss-120b deepseek-v3}
TOKENS=${TOKENS:-9 11 13 17 21 25 33 41}
FORMAT=${FORMAT:-bf16}
ALT=${ALT:-CUPYMOE_DECODE_KERNEL=register}
for run in table alt; do
  knob=()
  [ "$run" = alt ] && knob=("$ALT")
  env "${knob[@]}" timeout "${BENCH_S:-300}" python3 -P -m cupymoe bench --no-peers --preset $PRESETS --format "$FORMAT" \
    --tokens $TOKENS --json "$DEST/within-$run.json" > "$DEST/within-$run.log" 2>&1
  echo "bench $run${knob:+ ($ALT)} rc $?"
done
python3 - "$DEST" "$ALT" <<'PY'
import json, os, sys
dest, alt = sys.argv[1], sys.argv[2]
runs = [f"{dest}/within-{r}.json" for r in ("table", "alt")]
if missing := [r for r in runs if not os.path.exists(r)]:
    sys.exit(f"no result {', '.join(missing)}: see its log beside it")
table, other = (json.load(open(r))["rows"] for r in runs)
for t, a in zip(table, other):
    print(f"{t['shape']:16} {t['format']:9} N={t['N']:<5} touched {t['touched']:<4} {alt} {a['us']:9.1f} us  "
          f"table {t['us']:9.1f} us  {100 * (t['us'] / a['us'] - 1):+.1f} %")
PY
