"""scripts/ncu_launches.py on a made-up ncu --csv --page raw run: a row a launch, units scaled, stalls ranked."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("ncu_launches", Path(__file__).parent.parent / "scripts" / "ncu_launches.py")
ncu_launches = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ncu_launches)

STALLS = [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"
          for s in ("long_scoreboard", "barrier", "wait", "selected", "membar", "sleeping", "drain")]
HEAD = ['ID', 'Kernel Name', 'gpu__time_duration.sum', 'dram__bytes_read.sum', 'launch__grid_size', *STALLS]
UNITS = ['', '', 'ns', 'Kbyte', '', *([''] * len(STALLS))]


def csv_text(rows):
    def q(cells):
        return ",".join(f'"{c}"' for c in cells) + "\n"
    return "==PROF== Connected to process 1\n" + q(HEAD) + q(UNITS) + "".join(q(r) for r in rows)


def test_a_launch_a_row_in_order_with_units_scaled_and_stalls_ranked():
    text = csv_text([["0", "void decode_wgmma_gate_up_a8<32>(const int *, int)", "157,280", "405,199", "1,536",
                      "3.78", "1.79", "1.65", "1", "0.43", "0.1", "0.05"],
                     ["1", "fused_moe_kernel", "89856", "203", "2528", "3", "1.5", "1", "1", "0", "0", "0.2"]])
    first, second = ncu_launches.launches(text)
    assert first["kernel"] == "decode_wgmma_gate_up_a8<32>" and second["kernel"] == "fused_moe_kernel"
    assert (first["us"], first["dram_read_MB"], first["grid"]) == (157.28, 405.2, 1536)
    assert list(first["stall_cycles_per_issue"]) == ["long_scoreboard", "barrier", "wait", "selected", "membar",
                                                     "sleeping"]  # the six largest, largest first
    assert "l2_pct_of_peak" not in first  # a metric the run did not ask for is left out, not made up


def test_a_run_without_a_table_has_no_launches():
    assert ncu_launches.launches("==ERROR== failed\n") == []
