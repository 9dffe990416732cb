#!/usr/bin/env bash
# compute-sanitizer's four tools over scripts/sanitize_workload.py (layers shaped like qwen3_moe and
# deepseek_v3: H = 2048, 32 / 64 experts, a shared expert, group-limited routing). Each tool's work
# is split into slices, one process each with its own timeout and log, sized to finish within
# ~100 s on an H200; together the slices of each tool cover every kernel family, path and format.
#
#   memcheck   a slice a format: both families, rows 1 5 12 64 640, every path
#   synccheck  the same slices as memcheck
#   racecheck  (~100x slower on shared memory) a slice a format, family and path group: decode +
#              atomic at rows 1 5 12 64, prefill at 64 and 640; --racecheck-report hazard
#   (and racecheck, synccheck, memcheck on the LoRA plans: --lora, w8a16 fp8 and bf16, rows 1 37 300)
#   initcheck  a slice a format and path group (decode + atomic, prefill); prefill with the grouped
#              down on the cp.async "twin" GEMM (CUPYMOE_SM90_DOWN_VARIANT=twin: yw stored by
#              st.global), since initcheck does not see TMA bulk-tensor stores and flags
#              grouped_reduce's reads of yw as unwritten; bf16 prefill also with no TMA at all
#              (CUPYMOE_SM90_VARIANT=twin); TMA_INITCHECK=1 adds the default variant's slice
#
# Rows: 1 and 5 take the fused routing + lists (decode_route_lists), 12 decode_topk_lists, 64
# topk_route with the one-block lists and the grouped "stream" GEMMs, 640 the three-pass sort and
# the math-bound GEMMs (wgmma and TMA on Hopper).
#
#   bash scripts/sanitize.sh                            every slice of the four tools
#   TOOLS="racecheck initcheck" bash scripts/sanitize.sh
#   ONLY="initcheck:bf16-prefill" bash scripts/sanitize.sh   slices whose tool:name matches a regex
# Env: OUT (logs, default /tmp/sanitize), CS (the compute-sanitizer binary), SLICE_TIMEOUT (s, 120),
# JOBS (slices run at once, 1).
# Prints a line a slice (rc, errors or hazards, seconds) and a total a tool; exit 1 on any finding
# or a slice cut by its timeout.
set -u
OUT=${OUT:-/tmp/sanitize}
mkdir -p "$OUT"
# the workload imports cupymoe from this tree (a script's own folder is its first import path)
export PYTHONPATH=$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
CS=${CS:-/usr/local/cuda/bin/compute-sanitizer}
FORMATS="bf16 fp8_block nvfp4 mxfp4"
FAMILIES="qwen3_moe deepseek_v3"
DECODE="--paths decode atomic --tokens 1 5 12 64"
PREFILL="--paths prefill --tokens 64 640"
LORA_ROWS="--paths decode prefill --tokens 1 37 300"

# tool:name|environment|workload arguments, one slice a line, the slowest tool first
slices() {
  local f fam
  for f in $FORMATS; do
    for fam in $FAMILIES; do
      echo "racecheck:$f-$fam-decode||--formats $f --families $fam $DECODE"
      echo "racecheck:$f-$fam-prefill||--formats $f --families $fam $PREFILL"
    done
  done
  # prefill with down's yw stored by st.global: initcheck does not track TMA bulk-tensor stores
  # (benchmarks/results/20261202-h200-initcheck.json); memcheck, racecheck and synccheck run the default
  for f in $FORMATS; do
    echo "initcheck:$f-decode||--formats $f $DECODE"
    echo "initcheck:$f-prefill|CUPYMOE_SM90_DOWN_VARIANT=twin|--formats $f $PREFILL"
  done
  echo "initcheck:bf16-prefill-twin|CUPYMOE_SM90_VARIANT=twin|--formats bf16 $PREFILL"
  [[ ${TMA_INITCHECK:-0} == 1 ]] && echo "initcheck:bf16-prefill-tma-stores||--formats bf16 $PREFILL"
  for f in $FORMATS; do echo "memcheck:$f||--formats $f"; done
  for f in $FORMATS; do echo "synccheck:$f||--formats $f"; done
  # LoRA: the stacked GEMMs beside their shrinks (by PDL), w8a16 with a shared expert and bf16
  for tool in racecheck synccheck memcheck; do
    echo "$tool:lora-fp8-w8a16||--lora --fp8-compute w8a16 --formats fp8_block --families qwen2_moe deepseek_v3 $LORA_ROWS"
    echo "$tool:lora-bf16||--lora --formats bf16 --families qwen3_moe $LORA_ROWS"
  done
}

# the findings a log reports: memcheck / synccheck / initcheck errors, racecheck hazards
findings() {
  grep -hoE "ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard" "$1" | grep -oE "[0-9]+" | tail -1
}

# one small layer loads every module: compiled (and cached) outside the tools
python3 scripts/sanitize_workload.py --tokens 1 --paths decode --formats bf16 --families qwen3_moe > /dev/null 2>&1
# one slice: its compute-sanitizer run, then one result line "tool|findings|failed|text" in $OUT/$tool-$name.result
run_slice() {
  local id=$1 env=$2 args=$3 tool=${1%%:*} name=${1#*:} extra="" log rc n forwards t0=$SECONDS
  [[ $tool == racecheck ]] && extra="--racecheck-report hazard"
  log="$OUT/$tool-$name.log"
  # shellcheck disable=SC2086  # env and args are word lists
  env $env timeout "${SLICE_TIMEOUT:-120}" "$CS" --tool "$tool" $extra --target-processes all --print-limit 20 \
    python3 scripts/sanitize_workload.py $args < /dev/null > "$log" 2>&1
  rc=$?
  n=$(findings "$log")
  forwards=$(grep -hoE "sanitize_workload: [0-9]+ forwards, [0-9]+ wrong" "$log" | tail -1)
  if [[ $rc == 124 || $rc == 137 ]]; then
    echo "$tool|0|1|$tool $name: TIMEOUT after $((SECONDS - t0)) s (${SLICE_TIMEOUT:-120} s limit)"
  elif [[ -z $n ]]; then
    echo "$tool|0|1|$tool $name: rc $rc, no summary (see $log)"
  else
    local bad=0
    [[ $n != 0 || $rc != 0 ]] && bad=1
    echo "$tool|$n|$bad|$tool $name${env:+ [$env]}: rc $rc, $n findings, $((SECONDS - t0)) s; ${forwards:-no workload summary}"
  fi > "$OUT/$tool-$name.result"
}

# JOBS slices at once (each is one CPU-bound process; the GPU is mostly idle under the tools)
rm -f "$OUT"/*.result
while IFS='|' read -r id env args; do
  tool=${id%%:*}
  [[ " ${TOOLS:-memcheck synccheck racecheck initcheck} " == *" $tool "* ]] || continue
  [[ -z ${ONLY:-} || $id =~ ${ONLY} ]] || continue
  while (( $(jobs -rp | wc -l) >= ${JOBS:-1} )); do wait -n; done
  run_slice "$id" "$env" "$args" &
done < <(slices)
wait
failed=0
for tool in ${TOOLS:-memcheck synccheck racecheck initcheck}; do
  total=0
  for r in "$OUT/$tool-"*.result; do
    [[ -e $r ]] || continue
    IFS='|' read -r _ n bad text < "$r"
    echo "$text"
    total=$((total + n))
    [[ $bad == 1 ]] && failed=1
  done
  echo "== $tool: $total findings"
done
exit $failed
