"""Two inputs' tune sweeps as one result file: the seed-0 results' cells, the seed-1 results' cells
(`cells_seed1`), and as its table only the rows of cells where both inputs chose the same plan; the meta
says which cells disagreed, with both inputs' figures, so those keep the table's plan. `python -m cupymoe
tune --apply` then files the rows as from any sweep.

    python scripts/tune_seeds.py --seed0 s0-1.json s0-2.json --seed1 s1-1.json s1-2.json --out RESULT.json
        [--changes-only]     (leave out rows whose plan is the default the sweep timed against)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cell_key(cell: dict) -> tuple:
    return cell["shape_key"], cell["format_key"], cell["N"]


def row_key(row: dict) -> tuple:
    return row["shape"], row["format"], row["measured_at"]


def _load(paths: list[Path]) -> tuple[list[dict], list[dict], list[dict]]:
    """The files' cells, table rows and metas, in the order given."""
    cells, rows, metas = [], [], []
    for p in paths:
        d = json.loads(Path(p).read_text())
        cells += d["cells"]
        rows += d.get("table", [])
        metas.append(d["meta"])
    return cells, rows, metas


def _figure(cell: dict) -> str:
    ch, de = cell["chosen"], cell["default"]
    return f"{ch['label']} {ch['us']}" + ("" if ch["label"] == de["label"] else f" against {de['label']} {de['us']}")


def merge(seed0: list[Path], seed1: list[Path], changes_only: bool = False) -> dict:
    cells0, rows0, metas = _load(seed0)
    cells1, _, _ = _load(seed1)
    by_key1 = {cell_key(c): c for c in cells1}
    agreed, differ, missing = set(), [], []
    for c in cells0:
        other = by_key1.get(cell_key(c))
        if other is None:
            missing.append(c)
        elif other["chosen"]["label"] == c["chosen"]["label"]:
            agreed.add(cell_key(c))
        else:
            differ.append((c, other))
    table = [r for r in rows0 if row_key(r) in agreed and not (changes_only and r["us"] == r["default_us"])]
    notes = [f"{c['shape']} {c['format_key']} {c['N']} (seed 0 {_figure(c)}; seed 1 {_figure(o)})" for c, o in differ]
    notes += [f"{c['shape']} {c['format_key']} {c['N']} (no seed-1 cell)" for c in missing]
    confirmation = (f"the same sweeps with --seed 1 (cells_seed1): the same choice in {len(agreed)} of {len(cells0)} "
                    "cells" + (f"; not filed: {'; '.join(notes)}" if notes else ""))
    if changes_only:
        confirmation += "; rows whose plan is the sweep's default left out"
    meta = {**metas[0], "command": " ; ".join(m["command"] for m in metas), "confirmation": confirmation}
    meta.pop("seconds", None)
    return {"meta": meta, "cells": cells0, "cells_seed1": cells1, "table": table}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed0", nargs="+", type=Path, required=True)
    ap.add_argument("--seed1", nargs="+", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--changes-only", action="store_true")
    args = ap.parse_args(argv)
    result = merge(args.seed0, args.seed1, args.changes_only)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.out}: {len(result['table'])} rows; {result['meta']['confirmation']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
