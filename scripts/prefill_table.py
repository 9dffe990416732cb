#!/usr/bin/env python3
"""Issue 40's table: each prefill cell of `python -m cupymoe bench` runs beside vLLM timed in the
same device call (scripts/prefill_check.sh makes all three files).

    python scripts/prefill_table.py BENCH.json [BENCH.json ...] [--peers PEER.json PEER_FP8.json]

The bars (docs/PERFORMANCE.md, issue 40): fp8_block >= 60 % of the fp8 floor (the routed experts'
FLOPs at the fp8 rate) and >= 1.6x vLLM's fp8 GEMMs; bf16 >= 75 % of the floor and >= 1.25x vLLM's
compute-only time. vLLM's figure is the same call's, "-" where the call has none (never the stored
baselines: those are another machine's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple


class Bar(NamedTuple):
    floor_key: str  # the bench row's percent-of-floor column this format is judged by
    floor_pct: float
    vs_vllm: float
    peer_key: str  # the peer file's column of vLLM's time


BARS = {"fp8_block": Bar("pct_of_fp8_floor", 60.0, 1.6, "vllm_fp8_gemms_only"),
        "bf16": Bar("pct_of_floor", 75.0, 1.25, "vllm_compute_only")}


def peer_times(paths: list) -> dict:
    """{(format, shape, N): vLLM µs} of one call's peer files."""
    out = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        for r in doc["rows"] if isinstance(doc, dict) else doc:
            for fmt, bar in BARS.items():
                if r.get(bar.peer_key):
                    out[(fmt, r["shape"], r["N"])] = r[bar.peer_key]
    return out


def table(rows: list, vllm: dict) -> tuple[list[str], int, int]:
    """The Markdown lines, the cells within both bars and the cells judged."""
    lines = ["| shape | format | N | µs | % of floor | vs vLLM | within |", "|---|---|---|---|---|---|---|"]
    within = judged = 0
    for r in rows:
        bar = BARS.get(r["format"])
        if bar is None:
            continue
        pct, v = r[bar.floor_key], vllm.get((r["format"], r["shape"], r["N"]))
        vs = v / r["us"] if v else None
        ok = pct >= bar.floor_pct and vs is not None and vs >= bar.vs_vllm
        judged += 1
        within += ok
        vs_s = f"{vs:.2f}x" if vs else "-"
        lines.append(f"| {r['shape']} | {r['format']} | {r['N']} | {r['us']:.1f} | {pct:.1f} | {vs_s} | "
                     f"{'yes' if ok else 'no'} |")
    return lines, within, judged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", nargs="+", type=Path)
    ap.add_argument("--peers", nargs="*", type=Path, default=[])
    args = ap.parse_args()
    rows = [r for b in args.bench for r in json.loads(b.read_text())["rows"]]
    lines, within, judged = table(rows, peer_times(args.peers))
    print("\n".join(lines))
    print(f"\n{within} of {judged} cells within both bars")


if __name__ == "__main__":
    main()
