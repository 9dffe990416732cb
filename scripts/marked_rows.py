"""The tune commands that re-time the tuning table's by_shape rows marked `timed_on` another GPU (rows an
H100 sweep put in the H200's table with `tune --apply --other-gpu`), one a preset, format and fp8 compute:

    python scripts/marked_rows.py              # prints the commands
    python scripts/marked_rows.py | bash       # on the table's GPU: runs them (JSON into benchmarks/results)

Then `python -m cupymoe tune --apply RESULT` for each result replaces the marked rows with unmarked ones.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(table: dict) -> list[str]:
    groups: dict[tuple[str, str, str], set[int]] = defaultdict(set)
    for r in table["by_shape"]["value"]:
        if "timed_on" in r:
            fmt, _, compute = r["format"].partition(":")
            groups[(r["preset"], fmt, compute)].add(int(r["measured_at"]))
    out = []
    for (preset, fmt, compute), ns in sorted(groups.items()):
        extra = f" --fp8-compute {compute}" if compute else ""
        tag = f"{preset}-{fmt}{'-' + compute if compute else ''}"
        out.append(f"python -m cupymoe tune --preset {preset} --format {fmt}{extra} --tokens "
                   f"{' '.join(map(str, sorted(ns)))} --json benchmarks/results/retime-{tag}.json")
    return out


def main() -> int:
    table = json.loads((ROOT / "cupymoe" / "data" / "tuning.json").read_text())
    print("\n".join(commands(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
