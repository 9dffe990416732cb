"""An ncu `--csv --page raw` run (one row a kernel launch, a units row under the header) as JSON: each
launch's time, DRAM bytes and throughput, L2 and SM throughput, occupancy, issue rate, registers, grid
and its six largest stall reasons (cycles an issued instruction). For scripts/fp8_serving_ncu.sh,
whose tarball holds one CSV a run (ours-N.csv, vllm-N.csv, or a forced form's TAG-N.csv).

    python scripts/ncu_launches.py RUN.csv [RUN.csv ...]     (JSON on stdout: {file stem: [launch, ...]})
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_kernel_table import SCALE, rows  # noqa: E402  (the CSV's table and its units, as that script reads them)

FIELDS = {"us": "gpu__time_duration.sum", "dram_read_MB": "dram__bytes_read.sum",
          "dram_pct_of_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
          "l2_pct_of_peak": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
          "sm_pct_of_peak": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
          "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
          "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
          "registers": "launch__registers_per_thread", "grid": "launch__grid_size"}
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
TOP_STALLS = 6


def number(text: str, unit: str) -> float:
    return float(text.replace(",", "")) * SCALE.get(unit, 1.0)


def launches(text: str) -> list[dict]:
    """The launches of one raw CSV, in launch order (nothing where ncu wrote no table)."""
    table = rows(text)
    if not table:
        return []
    units, out = table[0], []  # --page raw: a units row under the header
    for r in table[1:]:
        launch = {"kernel": re.sub(r"\(.*", "", r["Kernel Name"]).replace("void ", "").strip()}
        for name, metric in FIELDS.items():
            if metric in r:
                v = number(r[metric], units[metric])
                launch[name] = int(v) if name in ("registers", "grid") else round(v, 2)
        stalls = {m.group(1): round(float(v), 2) for k, v in r.items() if (m := STALL.match(k))}
        launch["stall_cycles_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:TOP_STALLS])
        out.append(launch)
    return out


if __name__ == "__main__":
    print(json.dumps({Path(p).stem: launches(Path(p).read_text()) for p in sys.argv[1:]}, indent=1))
