#!/usr/bin/env bash
# The LoRA decode deltas' early start (DECISIONS.md "LoRA: the decode deltas start beside the base
# kernels"; issue 42) in one GPU command, under 3 minutes:
#   1. tests/test_gpu_lora.py whole (with the test_early_start_* cases: H = 4104 and I = 2056 past
#      the held columns, a 288-expert router, ranks 8 and 12, ids -1 / 0 / 1 and past the slots,
#      forced register and swap-AB decodes, fp8_block w8a16, each forward twice bit for bit and
#      equal to the separated plan's, decode graph replay);
#   2. bench --lora 4 --lora-rank 16 at N = 1, 8, 64, 256 for qwen3-30b-a3b and deepseek-v3, bf16
#      and fp8_block (w8a16), JSON into $OUT/ldc_<preset>_<format>.json, then the overhead table.
#
#   OUT=/tmp/out bash scripts/lora_decode_check.sh
set -u
DEST=${OUT:?set OUT to a folder for the logs}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout 84 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py > "$DEST/ldc_tests.log" 2>&1
echo "test_gpu_lora rc $?: $(tail -1 "$DEST/ldc_tests.log")"
grep -E "FAILED|ERROR|Error" "$DEST/ldc_tests.log" | head -8

bench() {
  local limit=$1 preset=$2 fmt=$3
  shift 3
  timeout "$limit" python3 -m cupymoe bench --preset "$preset" --format "$fmt" --tokens 1 8 64 256 --lora 4 \
    --lora-rank 16 --no-peers --repeats 5 --replays 10 --json "$DEST/ldc_${preset}_$fmt.json" "$@" \
    > "$DEST/ldc_${preset}_$fmt.log" 2>&1
  echo "bench $preset $fmt rc $?"
  grep "N=" "$DEST/ldc_${preset}_$fmt.log"
}
bench 18 qwen3-30b-a3b bf16
bench 18 qwen3-30b-a3b fp8_block --fp8-compute w8a16
bench 30 deepseek-v3 bf16
bench 30 deepseek-v3 fp8_block --fp8-compute w8a16

# the overhead table (bar: <= 25 % at N = 1, <= 15 % from N = 64)
python3 - "$DEST" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/ldc_*.json")):
    rows = json.load(open(f)).get("rows", [])
    for r in rows:
        if r.get("lora_us") is not None:
            print(f"{f.split('/')[-1][4:-5]:<30} N={r['N']:<4} base {r['base_us']:7.1f}  lora {r['lora_us']:7.1f}"
                  f"  {r['overhead_pct']:+6.1f}%")
PY
