#!/usr/bin/env bash
# compute-sanitizer's four tools over scripts/sanitize_workload.py (every kernel family, path and
# format); a summary line a tool. Logs under $OUT (default /tmp/sanitize).
#   bash scripts/sanitize.sh                    all four tools
#   TOOLS="memcheck initcheck" bash scripts/sanitize.sh
set -u
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
CS=${CS:-/usr/local/cuda/bin/compute-sanitizer}
python3 scripts/sanitize_workload.py --tokens 1 > /dev/null 2>&1  # compile (and cache) outside the tools
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  extra=""
  tokens="1 5 64 640"
  case $tool in
    racecheck) extra="--racecheck-report hazard"; tokens="1 5 64";;  # ~100x slower: fewer rows
    initcheck) extra="";;
  esac
  timeout ${TOOL_TIMEOUT:-150} "$CS" --tool $tool $extra --target-processes all --print-limit 20 \
    python3 scripts/sanitize_workload.py --tokens $tokens ${WORKLOAD_ARGS:-} > "$OUT/$tool.log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|sanitize_workload:" "$OUT/$tool.log" | tail -3 | tr '\n' ' ')
  echo "$tool rc $rc: $summary"
done
