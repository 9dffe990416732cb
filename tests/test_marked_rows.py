"""scripts/marked_rows.py: one tune command a preset, format and fp8 compute covers every by_shape row the
table marks timed_on another GPU, each a command tune's own parser takes."""

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from cupymoe import tune

ROOT = Path(__file__).resolve().parent.parent


def test_the_commands_re_time_every_marked_row():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "marked_rows.py")], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    ap = argparse.ArgumentParser()
    tune.add_tune_args(ap)
    covered = set()
    for line in out:
        argv = shlex.split(line)
        assert argv[:4] == ["python", "-m", "cupymoe", "tune"]
        a = ap.parse_args(argv[4:])
        compute = "" if a.fp8_compute == "auto" else a.fp8_compute
        covered |= {(p, f, compute, n) for p in a.preset for f in a.formats for n in a.tokens}
    table = json.loads((ROOT / "cupymoe" / "data" / "tuning.json").read_text())
    marked = {(r["preset"], *r["format"].partition(":")[::2], r["measured_at"])
              for r in table["by_shape"]["value"] if "timed_on" in r}
    assert marked and marked <= covered
