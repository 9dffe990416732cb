"""A GPU's by_device rows against the tuning table's own, from tune sweeps timed on that GPU.

A sweep times every candidate plan of each cell, the section's plan and the one the table's own rows
give among them (run with the rows in the package, the section's is its default: a check on another
input; on the sweep that chose the rows, the figures are that sweep's own). For each cell this prints
(and with --json writes) both times and their difference; no GPU needed:

    python scripts/device_rows_check.py RESULT.json [RESULT.json ...] [--json OUT.json]

A cell whose table plan was not timed (pruned at the floor, or launching what another candidate does)
says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupymoe import bench, tune  # noqa: E402
from cupymoe.knobs import Knobs  # noqa: E402
from cupymoe.plan import DeviceFacts, LayerOptions, plan_layer  # noqa: E402


# what the plans read of each GPU a sweep may come from (SMs, opt-in shared memory a block)
GPUS = {"NVIDIA H100 80GB HBM3": (132, 232448), "NVIDIA H200": (132, 232448)}


def table_label(shape: str, fmt_key: str, n: int, gpu: str) -> tuple[str, str]:
    """(the label of what the layer runs at n with the GPU's rows, without them), as with no knob set."""
    if gpu not in GPUS:
        sys.exit(f"device_rows_check.py: no SM count known for {gpu!r} (add it to GPUS)")
    cfg = bench.preset_config(shape)
    fmt, _, compute = fmt_key.partition(":")
    dev = DeviceFacts("sm_90a", *GPUS[gpu], gpu)
    opts = LayerOptions(fp8_compute=compute or "auto")
    out = []
    for name in (gpu, ""):
        lp = plan_layer(cfg, fmt, None, "sm_90a", n_local=cfg.num_experts, options=opts, knobs=Knobs(),
                        device_name=name)
        out.append(tune.default_choice(lp, dev, n).label())
    return out[0], out[1]


def rows(results: list[Path]) -> list[dict]:
    out = []
    for path in results:
        doc = json.loads(path.read_text())
        gpu = doc["meta"]["gpu"]
        for c in doc["cells"]:
            own, table = table_label(c["shape"], c["format_key"], c["N"], gpu)
            timed = {t["label"]: t["us"] for t in c["candidates"]}
            row = dict(shape=c["shape"], format=c["format_key"], N=c["N"], gpu_rows_plan=own,
                       gpu_rows_us=timed.get(own), table_plan=table, table_us=timed.get(table),
                       result=path.name)
            if row["gpu_rows_us"] and row["table_us"]:
                row["change_pct"] = round(100 * (row["gpu_rows_us"] / row["table_us"] - 1), 1)
            out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    found = rows(args.results)
    for r in found:
        us = lambda v: f"{v:9.1f}" if v else "  untimed"
        change = f"{r['change_pct']:+.1f} %" if "change_pct" in r else "-"
        same = " (same plan)" if r["gpu_rows_plan"] == r["table_plan"] else ""
        print(f"{r['shape']:16} {r['format']:15} N={r['N']:<5} rows {r['gpu_rows_plan']:45} {us(r['gpu_rows_us'])}  "
              f"table {r['table_plan']:45} {us(r['table_us'])}  {change}{same}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
