"""An ncu --csv run (raw metrics, one row a kernel launch and metric) as a table a kernel: the median
of its launches for each metric, kernels in first-launch order; the kernels that draw the run's
random weights and inputs (CuPy's elementwise and reductions, cuRAND's) are left out, so the table
holds the layer's kernels alone. For scripts/lora_kernel_times.sh.

    python scripts/ncu_kernel_table.py NCU.csv
"""

import csv
import io
import re
import statistics
import sys

COLUMNS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "launch__registers_per_thread", "launch__grid_size",  # us, MB, %, registers, blocks
           "lts__throughput.avg.pct_of_peak_sustained_elapsed",  # L2 %
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",  # SM %
           "sm__warps_active.avg.pct_of_peak_sustained_active")  # achieved occupancy %
SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,  # to us
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}  # to MB


def rows(text: str):
    start = text.find('"ID"')
    return list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []


SETUP = re.compile(r"^(void )?(cupy_|cub::|init_curand|execute_dist)")  # the weights' and inputs' draws


def short(name: str) -> str:
    return re.sub(r"\(.*", "", name).strip()[:48]


def table(text: str) -> str:
    seen: dict[str, dict[str, list[float]]] = {}
    for r in rows(text):
        if SETUP.match(r["Kernel Name"]):
            continue
        value = float(r["Metric Value"].replace(",", "")) * SCALE.get(r["Metric Unit"], 1.0)
        seen.setdefault(short(r["Kernel Name"]), {}).setdefault(r["Metric Name"], []).append(value)
    lines = []
    for kernel, metrics in seen.items():
        cells = [f"{statistics.median(metrics[m]):9.2f}" if m in metrics else "        -" for m in COLUMNS]
        lines.append(f"  {kernel:<48} " + " ".join(cells))
    return "\n".join(lines) if lines else "  (no kernels: see the run's .err)"


if __name__ == "__main__":
    print(table(open(sys.argv[1]).read()))
