#!/usr/bin/env bash
# The LoRA decode deltas' early start (DECISIONS.md "LoRA: the decode deltas start beside the base
# kernels"; issue 42) in one GPU command, under 3 minutes:
#   0. the kernel cache compiled (a fresh machine's is cold);
#   1. tests/test_gpu_lora.py whole, the test_early_start_* cases first (H = 4104 or I = 2056 past
#      the held columns, a 288-expert router, ranks 8 and 12, ids -1 / 0 / 1 and past the slots,
#      forced register and swap-AB decodes, fp8_block w8a16, each forward twice bit for bit and
#      equal to the separated plan's, decode graph replay);
#   2. bench --lora 4 --lora-rank 16 at N = 1, 8, 64, 256 for qwen3-30b-a3b and deepseek-v3, bf16
#      and fp8_block (w8a16), JSON into $OUT/ldc_<preset>_<format>.json, then the overhead table.
#
#   OUT=/tmp/out bash scripts/lora_decode_check.sh
. "$(dirname "$0")/lora_bench.sh"  # DEST, the repository root, lora_tests, lora_bench
timeout 25 python3 -m cupymoe kernels --arch sm_90a > "$DEST/ldc_kernels.log" 2>&1  # a fresh machine's cold cache
echo "kernels rc $?: $(tail -1 "$DEST/ldc_kernels.log")"
lora_tests 35 ldc_early early_start  # the new cases first: their verdict even if the rest runs out of time
lora_tests 55 ldc_rest "not early_start"
lora_bench_presets 14 18 ldc "1 8 64 256"

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
