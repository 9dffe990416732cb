"""A GPU's by_device rows against the tuning table's own, from tune sweeps timed on that GPU.

A sweep run with the rows in the package times their plan as its default and every candidate beside
it, the plan the table's own rows give among them. For each cell this prints (and with --json writes)
both times and their difference; no GPU needed:

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
from cupymoe.plan import DeviceFacts, LayerOptions, plan_layer  # noqa: E402


def table_label(shape: str, fmt_key: str, n: int, gpu: str) -> tuple[str, str]:
    """(the label of what the layer runs at n with the GPU's rows, without them)."""
    cfg = bench.preset_config(shape)
    fmt, _, compute = fmt_key.partition(":")
    dev = DeviceFacts("sm_90a", 132, 232448, gpu)
    opts = LayerOptions(fp8_compute=compute or "auto")
    out = []
    for name in (gpu, ""):
        lp = plan_layer(cfg, fmt, None, "sm_90a", n_local=cfg.num_experts, options=opts, device_name=name)
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
