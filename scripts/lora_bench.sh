# Sourced first by the LoRA GPU checks (lora_check.sh, lora_decode_check.sh, lora_shrink_check.sh,
# lora_knob_check.sh): DEST from $OUT, the repository root as the working folder and on
# PYTHONPATH, then the steps they share.
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# lora_tests LIMIT_S TAG [pytest -k expression]: tests/test_gpu_lora.py into $DEST/<tag>_tests.log.
lora_tests() {
  local limit=$1 log="$DEST/$2_tests.log"
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py ${3:+-k "$3"} > "$log" 2>&1
  echo "test_gpu_lora rc $?: $(tail -1 "$log")"
  grep -E "FAILED|ERROR" "$log" | head -8
}

# lora_bench LIMIT_S TAG PRESET FORMAT "TOKENS" [more bench arguments]: one preset's cells with 4
# adapters of rank 16, JSON and log into $DEST/<tag>_<preset>_<format>.*, its "N=" lines echoed.
lora_bench() {
  local limit=$1 tag=$2 preset=$3 fmt=$4 tokens=$5
  shift 5
  # shellcheck disable=SC2086  # the token counts split on purpose
  timeout "$limit" python3 -m cupymoe bench --preset "$preset" --format "$fmt" --tokens $tokens --lora 4 \
    --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/${tag}_${preset}_$fmt.json" "$@" \
    > "$DEST/${tag}_${preset}_$fmt.log" 2>&1
  echo "bench $preset $fmt rc $?"
  grep "N=" "$DEST/${tag}_${preset}_$fmt.log"
}

# lora_bench_presets QWEN3_LIMIT_S DEEPSEEK_LIMIT_S TAG "TOKENS": qwen3-30b-a3b and deepseek-v3, each
# in bf16 and fp8_block (w8a16: the expert deltas need it).
lora_bench_presets() {
  local preset limit
  for preset in qwen3-30b-a3b deepseek-v3; do
    limit=$1
    [ "$preset" = deepseek-v3 ] && limit=$2
    lora_bench "$limit" "$3" "$preset" bf16 "$4"
    lora_bench "$limit" "$3" "$preset" fp8_block "$4" --fp8-compute w8a16
  done
}

# lora_scratch: the carried nvtx wheel installed, a scratch folder W (more files than the device tool
# brings back) handed back as $DEST/run.tgz at exit, and t0 for the steps' elapsed seconds.
lora_scratch() {
  pip install -q .whl/nvtx*.whl > /dev/null 2>&1
  W=$(mktemp -d)
  trap 'tar czf "$DEST/run.tgz" -C "$W" .' EXIT
  t0=$(date +%s)
}
