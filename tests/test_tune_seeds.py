"""scripts/tune_seeds.py on made-up sweeps: rows only where both inputs chose the same plan, disagreements
named with both inputs' figures, defaults left out on request."""

import importlib.util
import json
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("tune_seeds", Path(__file__).parent.parent / "scripts" / "tune_seeds.py")
tune_seeds = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(tune_seeds)


def cell(n, chosen, us, default="prefill/stream", default_us=100.0):
    return {"shape": "p", "shape_key": "H8 I8 E8/8 k2", "format_key": "nvfp4", "N": n,
            "chosen": {"label": chosen, "us": us}, "default": {"label": default, "us": default_us}}


def row(n, us, default_us=100.0):
    return {"shape": "H8 I8 E8/8 k2", "format": "nvfp4", "n": n, "measured_at": n, "us": us, "default_us": default_us}


def write(tmp_path, name, cells, rows, command):
    p = tmp_path / name
    p.write_text(json.dumps({"meta": {"gpu": "g", "command": command, "seconds": 3.0}, "cells": cells, "table": rows}))
    return p


def test_rows_where_both_inputs_agree_and_the_rest_named(tmp_path):
    s0 = write(tmp_path, "a.json", [cell(24, "decode", 80.0), cell(48, "decode", 90.0), cell(96, "prefill/stream", 100.0)],
               [row(24, 80.0), row(48, 90.0), row(96, 100.0)], "tune a")
    s1 = write(tmp_path, "b.json", [cell(24, "decode", 81.0), cell(48, "prefill/stream", 99.0),
                                    cell(96, "prefill/stream", 101.0)], [], "tune b")
    out = tune_seeds.merge([s0], [s1])
    assert [r["measured_at"] for r in out["table"]] == [24, 96]
    conf = out["meta"]["confirmation"]
    assert "2 of 3 cells" in conf and "p nvfp4 48 (seed 0 decode 90.0 against prefill/stream 100.0; seed 1 prefill/stream 99.0)" in conf
    assert out["meta"]["command"] == "tune a" and "seconds" not in out["meta"]
    assert len(out["cells_seed1"]) == 3
    changes = tune_seeds.merge([s0], [s1], changes_only=True)
    assert [r["measured_at"] for r in changes["table"]] == [24]  # 96's row is the default it was timed against


def test_a_cell_the_second_input_lacks_is_not_filed(tmp_path):
    s0 = write(tmp_path, "a.json", [cell(24, "decode", 80.0)], [row(24, 80.0)], "tune a")
    s1 = write(tmp_path, "b.json", [], [], "tune b")
    out = tune_seeds.merge([s0], [s1])
    assert out["table"] == [] and "p nvfp4 24 (no seed-1 cell)" in out["meta"]["confirmation"]


def test_the_command_line_writes_the_result(tmp_path, capsys):
    s0 = write(tmp_path, "a.json", [cell(24, "decode", 80.0)], [row(24, 80.0)], "tune a")
    s1 = write(tmp_path, "b.json", [cell(24, "decode", 79.0)], [], "tune b")
    out = tmp_path / "r.json"
    assert tune_seeds.main(["--seed0", str(s0), "--seed1", str(s1), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["table"][0]["measured_at"] == 24
    assert "1 rows" in capsys.readouterr().out
