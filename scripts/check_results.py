#!/usr/bin/env python3
"""Fail if a result file carries an absolute path of the machine that wrote it.

    python scripts/check_results.py [DIR ...]     (default: benchmarks/results)

Result files are data: they name other files by repository-relative paths or by file
name only (a bench's `baselines` field: benchmarks/baselines/h200-bf16-peers.json, not
/work/.../h200-bf16-peers.json). Exits 0 when every file is clean, 1 listing each file
and the paths it holds otherwise. Stdlib only, so a test can run it as a subprocess.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# A path from the file system's root (two or more segments: /tmp/x, /usr/bin/python3,
# /home/u/.../site-packages/...) or from a home directory (~/...). The look-behind keeps
# ratios and units out (TB/s, gate/up, 3/4) and the second slash of a URL's //.
ABSOLUTE = re.compile(r"(?<![\w.~/\\])(?:/(?:[A-Za-z0-9_.+@-]+/)+[A-Za-z0-9_.+@-]*|~/[^\s\"']+)")

ROOT = Path(__file__).resolve().parent.parent


def offending_paths(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", errors="replace")
    return sorted(set(ABSOLUTE.findall(text)))


def main(argv: list[str]) -> int:
    dirs = [Path(a) for a in argv] or [ROOT / "benchmarks" / "results"]
    bad: dict[Path, list[str]] = {}
    for d in dirs:
        if not d.is_dir():
            print(f"check_results: {d} is not a directory", file=sys.stderr)
            return 2
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            if f.suffix.lower() in (".png", ".svg", ".pdf"):
                continue
            found = offending_paths(f)
            if found:
                bad[f] = found
    if not bad:
        return 0
    print(f"{len(bad)} result file(s) carry absolute paths:", file=sys.stderr)
    for f, found in bad.items():
        shown = ", ".join(found[:3]) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
        print(f"  {f}: {shown}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
