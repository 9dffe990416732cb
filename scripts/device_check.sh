#!/usr/bin/env bash
# The whole GPU check of a session in one command (the lent machine's time is scarce):
# the GPU tests, then the benchmark grid with the torch peers, one process per preset
# (a failure in one preset cannot take the others down), then the quantized formats and
# the decode path forced at N = 16, 64 for them (the dispatch data). Logs, JSON and plots
# come back as $OUT/check.tgz.
#
#   OUT=/tmp/out bash scripts/device_check.sh
#   OUT=/tmp/out PARTS="tests verify fp8" bash scripts/device_check.sh   (a subset)
#   PARTS="tests": the GPU tests in SHARDS (default 12) shards side by side, SHARD_S seconds each
#   (default 420)
#   PARTS="hf": the CPU tests that need transformers (skipped in CI and on a machine without it; the
#   device image has it, and peft): against transformers' own MoE blocks, PEFT's adapters and merges
#   PARTS="equiv": the output bits against an older tree exported (git archive REV cupymoe cuda)
#   into .old/ (carried), scripts/plan_equivalence.py; with EQUIV_KNOBS="KNOB=V,KNOB=V" instead this
#   tree without those knobs against itself with them (a same-bits build knob's check)
#   PARTS="host": the eager forward's host time
#   PARTS="tune": the tuning sweep of the six presets, bf16 and fp8_block, N = 16-2048, into
#   $OUT/tune.json (apply it here with `python -m cupymoe tune --apply FILE`)
#   GRID_FLAGS=--no-peers: the grid without the torch peers (vLLM's figures still come
#   from benchmarks/baselines)
set -u
source scripts/kernel_cache_env.sh  # a carried kernel cache, unpacked once
PARTS=${PARTS:-"tests hf verify grid quant fp8"}
want() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
DEST=${OUT:?set OUT to a folder for the logs}
# the device tool brings back a limited number of files: work in a scratch folder and hand
# back one archive of it (check.tgz) at the end
OUT=$(mktemp -d)
mkdir -p "$OUT/plots"
trap 'tar czf "$DEST/check.tgz" -C "$OUT" .' EXIT
if want tests; then
  # the kernels built once, then the GPU tests collected and cut into SHARDS contiguous runs of
  # equal count, side by side (serially they take ~20 minutes; contiguous so a module's fixtures
  # are built by one or two shards; a shard that hits SHARD_S ends without its summary line: say
  # so, never count it)
  t0=$(date +%s)
  timeout 200 python3 -m cupymoe kernels > "$OUT/kernels.log" 2>&1
  echo "kernels rc $? ($(( $(date +%s) - t0 )) s)"
  python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only tests 2>/dev/null | grep "::" > "$OUT/gpu_test_ids.txt"
  mapfile -t ids < "$OUT/gpu_test_ids.txt"
  shards=${SHARDS:-12}
  per=$(( (${#ids[@]} + shards - 1) / shards ))
  echo "gpu tests: ${#ids[@]} collected, $shards shards of <= $per"
  for ((i = 0; i < shards; i++)); do
    part=("${ids[@]:$((i * per)):$per}")
    [ ${#part[@]} -gt 0 ] || continue
    printf '%s\n' "${part[@]}" > "$OUT/gpu_tests_$i.ids"  # a failure's replay runs the shard's tests in order
    OMP_NUM_THREADS=2 timeout "${SHARD_S:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "${part[@]}" \
      > "$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  for log in "$OUT"/gpu_tests_*.log; do
    last=$(tail -1 "$log")
    case "$last" in *" in "*) echo "gpu tests $(basename "$log" .log): $last";;
                    *) echo "gpu tests $(basename "$log" .log): STOPPED at ${SHARD_S:-420} s, no summary";; esac
    grep -E "^FAILED|^ERROR" "$log" | head -5
    # a module's tests draw from one generator in order: its seed and the shard's ids replay a failure
    if grep -qE "^FAILED|^ERROR" "$log"; then
      grep -oE "rng seed [0-9]+" "$log" | sort -u | while read -r _ _ seed; do
        echo "  replay: CUPYMOE_TEST_SEED=$seed python3 -m pytest -q -m gpu \$(cat $(basename "$log" .log).ids)"
      done
    fi
  done
  echo "gpu tests wall $(( $(date +%s) - t0 )) s"
fi
if want hf; then
  python3 -c "import transformers, peft; print('transformers', transformers.__version__, 'peft', peft.__version__)" \
    > "$OUT/hf_tests.log" 2>&1
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_integrations_transformers.py \
    tests/test_reference_vs_transformers.py tests/test_lora_peft.py >> "$OUT/hf_tests.log" 2>&1
  echo "hf tests rc $?: $(tail -1 "$OUT/hf_tests.log")"
  grep -E "^FAILED|^ERROR" "$OUT/hf_tests.log" | head -5
fi
if want equiv; then
  if [ -n "${EQUIV_KNOBS:-}" ]; then  # the same tree, plain, then under the knobs
    old_tree=. new_env=${EQUIV_KNOBS//,/ } old_env=
    for kv in ${EQUIV_KNOBS//,/ }; do old_env+=" -u ${kv%%=*}"; done  # the plain run free of them
  else
    old_tree=.old new_env= old_env=
  fi
  env $old_env PYTHONPATH=$old_tree timeout 240 python3 scripts/plan_equivalence.py --out "$OUT/equiv-old.json" > "$OUT/equiv.log" 2>&1
  env $new_env PYTHONPATH=. timeout 240 python3 scripts/plan_equivalence.py --out "$OUT/equiv-new.json" \
    >> "$OUT/equiv.log" 2>&1
  python3 scripts/plan_equivalence.py --compare "$OUT/equiv-old.json" "$OUT/equiv-new.json" >> "$OUT/equiv.log" 2>&1
  echo "equiv rc $?: $(tail -1 "$OUT/equiv.log")"
  grep DIFFERS "$OUT/equiv.log" | head -5
fi
if want host; then
  timeout 200 python3 -m cupymoe bench --preset qwen3-30b-a3b --format bf16 fp8_block --tokens 1 64 4096 --host \
    --no-peers --repeats 3 --replays 10 --json "$OUT/host.json" > "$OUT/host.log" 2>&1
  echo "host rc $?"
  grep "N=" "$OUT/host.log"
fi
if want tune; then
  timeout 420 python3 -m cupymoe tune --preset qwen3-30b-a3b qwen3-235b-a22b deepseek-v3 mixtral-8x7b qwen3-next-80b \
    gpt-oss-120b --format bf16 fp8_block --tokens 16 32 64 128 256 512 1024 2048 --time-limit 380 --json "$OUT/tune.json" \
    > "$OUT/tune.log" 2>&1
  echo "tune rc $?"
  grep -E "^\[tune|->" "$OUT/tune.log" | grep -v drawing | head -120
fi
if want verify; then
  timeout 150 python3 -m cupymoe verify > "$OUT/verify.log" 2>&1
  echo "verify (the main job) rc $?: $(tail -1 "$OUT/verify.log")"
fi
want grid && for p in qwen3-30b-a3b qwen3-235b-a22b deepseek-v3 mixtral-8x7b qwen3-next-80b gpt-oss-120b; do
  timeout 80 python3 -m cupymoe bench --preset "$p" --tokens 1 16 64 1024 4096 16384 --repeats 5 --replays 10 \
    --eager-max-tokens 64 --plots "$OUT/plots" --json "$OUT/grid-$p.json" ${GRID_FLAGS:-} > "$OUT/grid-$p.log" 2>&1
  echo "grid $p rc $?"
  grep "N=" "$OUT/grid-$p.log"
done
if want quant; then  # every quantized format (fp8 as the layer picks: w8a8 on sm_90a)
  timeout 150 python3 -m cupymoe bench --preset qwen3-30b-a3b deepseek-v3 --format fp8_block nvfp4 mxfp4 \
    --tokens 1 64 4096 --measure-ceilings --repeats 5 --replays 10 --no-peers \
    --json "$OUT/quant.json" > "$OUT/quant.log" 2>&1
  echo "quant rc $?"
  grep "N=" "$OUT/quant.log"
fi
want fp8 && for mode in w8a8 w8a16; do
  timeout 100 python3 -m cupymoe bench --preset qwen3-30b-a3b deepseek-v3 --format fp8_block \
    --fp8-compute $mode --tokens 1 64 4096 --measure-ceilings --repeats 5 --replays 10 --no-peers \
    --json "$OUT/fp8-$mode.json" > "$OUT/fp8-$mode.log" 2>&1
  echo "fp8 $mode rc $?"
  grep "N=" "$OUT/fp8-$mode.log"
done
true
