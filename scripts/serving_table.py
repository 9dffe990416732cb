#!/usr/bin/env python3
"""Issue 39's table: each tuned cell of `python -m cupymoe tune` beside vLLM and the byte floor.

    python scripts/serving_table.py TUNE.json [TUNE.json ...] [--peers PEER.json PEER_FP8.json] [--max-n 2048]
    python scripts/serving_table.py --call TUNE.json PEER.json PEER_FP8.json --call TUNE2.json PEER2.json ...
    python scripts/serving_table.py --call ... --against EARLIER_TUNE.json [...] [--within 0.6]

A later TUNE file's cell replaces an earlier one's of the same (shape, format, N) in place (a
re-tune of some presets over a whole sweep); --max-n leaves out larger N (a prefill sweep's).
--against names an earlier sweep's tune files: after the table, how many cells' chosen µs stay within
--within percent of that sweep's and each cell beyond it (a machine's drift read beside a change's).

vLLM's figure is the one timed in the same device call (peer_bench.py's peer.json for bf16,
peer_bench_fp8.py's peer_fp8.json for fp8_block): each --call names one call's files (tune
results and peer files, told apart by their contents) and its cells take only its own peers'
figures (the positional TUNE files and --peers are one such call); where the call timed no vLLM
figure for a cell, the stored baseline (benchmarks/baselines/h200-{bf16,fp8}-peers.json), marked "b",
only where the tune ran on the baseline's GPU (an H200), "-" elsewhere. Columns: the chosen
plan, its µs, ours over the floor (x floor) and vLLM's time over ours (> 1: we are faster).
Prints a Markdown table and the cells that miss either bar (at or below vLLM; within 1.15x of
the floor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = {"bf16": ("h200-bf16-peers.json", "vllm_compute_only"),
             "fp8_block": ("h200-fp8-peers.json", "vllm_fp8_gemms_only")}
FLOOR_BAR = 1.15


def peer_times(path: Path, key: str) -> dict:
    rows = json.loads(path.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    return {(r["shape"], r["N"]): r[key] for r in rows if r.get(key)}


def call_peers(paths: list) -> dict:
    """{format: {(shape, N): vLLM µs}} of one call's peer files (rows carrying a baseline key)."""
    out: dict = {}
    for p in paths:
        for fmt, (_, key) in BASELINES.items():
            out.setdefault(fmt, {}).update(peer_times(p, key))
    return out


def weight_format(cell: dict) -> str:
    """A tune cell's weight format without its compute form ("fp8_block:w8a8" -> "fp8_block")."""
    return cell["format_key"].split(":")[0]


def cell_key(cell: dict) -> tuple:
    return cell["shape"], weight_format(cell), cell["N"]


def latest_cells(calls: list, max_n=None) -> list:
    """(cell, its call's vLLM figures, the GPU it ran on) in first-seen order, each (shape, format, N)
    as its last call's last tune file has it; `calls` lists (tune files, peer files) a device call."""
    cells = {}
    for tunes, peers in calls:
        vllm = call_peers(peers)
        for t in tunes:
            doc = json.loads(Path(t).read_text())
            for c in doc["cells"]:
                if max_n is None or c["N"] <= max_n:
                    cells[cell_key(c)] = (c, vllm, doc["meta"].get("gpu"))
    return list(cells.values())


def stored_peers() -> dict:
    """{format: ({(shape, N): vLLM µs}, the GPU it was measured on)} of the stored baselines."""
    out = {}
    for fmt, (f, key) in BASELINES.items():
        path = ROOT / "benchmarks" / "baselines" / f
        out[fmt] = (peer_times(path, key), json.loads(path.read_text())["gpu"].split(" (")[0])
    return out


def split_call(paths: list) -> tuple[list, list]:
    """A call's files as (tune results, peer files): a tune result has "cells"."""
    tunes = [p for p in paths if "cells" in json.loads(Path(p).read_text())]
    return tunes, [p for p in paths if p not in tunes]


def changes_against(cells: list, earlier: list, within: float) -> list[str]:
    """Lines comparing each cell's chosen µs with the earlier sweep's same cell: a count, then the cells
    that moved past `within` percent (their plans before and now)."""
    before = {cell_key(c): c["chosen"] for c, _, _ in earlier}
    moved, same = [], 0
    for c, _, _ in cells:
        old = before.get(cell_key(c))
        if old is None:
            continue
        now = c["chosen"]
        change = 100.0 * (now["us"] / old["us"] - 1.0)
        if abs(change) <= within:
            same += 1
        else:
            moved.append(f"{c['shape']} {weight_format(c)} N={c['N']}: {old['label']} {old['us']:.1f} -> {now['label']} "
                         f"{now['us']:.1f} us ({change:+.1f} %)")
    return [f"\nAgainst the earlier sweep: {same} of {same + len(moved)} cells within {within:g} %; beyond it:",
            *moved]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tune", nargs="*", type=Path)
    ap.add_argument("--peers", nargs="*", type=Path, default=[])
    ap.add_argument("--call", nargs="+", type=Path, action="append", default=[],
                    help="one device call's tune results and peer files (repeat for each call)")
    ap.add_argument("--max-n", type=int, default=None, help="leave out cells of more rows")
    ap.add_argument("--against", nargs="+", type=Path, default=[],
                    help="an earlier sweep's tune files: each cell's chosen µs against its own there")
    ap.add_argument("--within", type=float, default=0.6, help="percent a cell may move and count as unchanged")
    args = ap.parse_args()
    calls = ([(args.tune, args.peers)] if args.tune else []) + [split_call(c) for c in args.call]
    if not calls:
        ap.error("no tune results: give TUNE files or --call")
    stored = stored_peers()
    print("| shape | format | N | plan | µs | x floor | vs vLLM |\n|---|---|---|---|---|---|---|")
    misses = []
    cells = latest_cells(calls, args.max_n)
    for c, same_call, gpu in cells:
        fmt = weight_format(c)
        ch, key = c["chosen"], (c["shape"], c["N"])
        v, mark = same_call.get(fmt, {}).get(key), ""
        stored_times, stored_gpu = stored[fmt]
        if v is None and gpu == stored_gpu:
            v, mark = stored_times.get(key), " b"
        x_floor = 100.0 / ch["pct_of_floor"]
        vs = v / ch["us"] if v else None
        vs_s = f"{vs:.2f}{mark}" if vs else "-"
        print(f"| {c['shape']} | {fmt} | {c['N']} | {ch['label']} | {ch['us']:.1f} | {x_floor:.2f} | {vs_s} |")
        if (vs is not None and vs < 1.0) or x_floor > FLOOR_BAR:
            misses.append(f"{c['shape']} {fmt} N={c['N']}: {ch['us']:.1f} us, x floor {x_floor:.2f}, vs vLLM {vs_s}")
    print(f"\n{len(misses)} cells miss a bar:")
    print("\n".join(misses))
    if args.against:
        print("\n".join(changes_against(cells, latest_cells([(args.against, [])], args.max_n), args.within)))


if __name__ == "__main__":
    main()
