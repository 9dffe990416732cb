"""scripts/device_rows_check.py on the committed H100 sweep that chose the section's three-quarter rows (its
figures are that sweep's own; the confirmations on other inputs are in 20261207-h100-s54-device-rows.json):
each cell's plan with the GPU's by_device rows against the plan by_shape alone gives (no GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "benchmarks" / "results" / "20261207-h100-s54-tune-mid-buckets.json"


def test_the_h100_rows_are_paired_with_the_tables_plans(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUPYMOE_")}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_rows_check.py"), str(SWEEP),
                          "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, check=True,
                         env={**env, "CUPYMOE_DEVICE_ROWS": "0"}).stdout  # the script plans as with no knob
    rows = {(r["shape"], r["format"], r["N"]): r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert len(rows) == len(out.splitlines()) == 56
    mixtral = rows[("mixtral-8x7b", "bf16", 96)]  # the H100's row at three quarters of 128
    assert mixtral["gpu_rows_plan"] == "decode/swapab/nt32" and mixtral["change_pct"] == -4.0
    assert mixtral["table_plan"] == "prefill/math/gate_up=tma_wide/down=tma_wide"
    # qwen3-30b-a3b's rows at 48 were taken out (slower at 40): the section gives the table's plan there
    assert rows[("qwen3-30b-a3b", "fp8_block:w8a8", 48)]["gpu_rows_plan"] == "decode/wgmma"
    assert "(same plan)" in next(line for line in out.splitlines() if "qwen3-30b-a3b    fp8_block:w8a8  N=48 " in line)
