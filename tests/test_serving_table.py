"""scripts/serving_table.py on the committed sweep: one row a tuned cell, vLLM from the same call first."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
R = ROOT / "benchmarks" / "results"


def _table(*args) -> str:
    """scripts/serving_table.py's output for these arguments (paths or strings)."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "serving_table.py"), *map(str, args)],
                          capture_output=True, text=True, check=True).stdout


def test_serving_table_reads_the_committed_sweep():
    tune = [R / "20261202-h200-s4-tune-qwen3-deepseek.json", R / "20261202-h200-s4-tune-rest.json"]
    peers = sorted(R.glob("20261202-h200-s4-peers-vllm-*.json"))
    out = _table(*tune, "--peers", *peers)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| shape")]
    assert len(rows) == 96  # six presets x two formats x eight N
    same_call = [r for r in rows if r.startswith(("| qwen3-30b-a3b |", "| deepseek-v3 |"))]
    assert same_call and not any(r.endswith(" b |") for r in same_call)
    assert "cells miss a bar" in out


def test_a_later_sweep_replaces_its_cells_in_place():
    tune = [R / "20261202-h200-s4-tune-qwen3-deepseek.json", R / "20261202-h200-s4-tune-rest.json",
            R / "20261202-h200-s5-tune-fp8-235b-mixtral.json"]
    out = _table(*tune, "--max-n", "2048")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| shape")]
    assert len(rows) == 96  # the re-tuned cells replace theirs; 4096 and 16384 left out
    assert "| mixtral-8x7b | fp8_block | 1024 | prefill/tma | 1270.7 |" in out


def test_each_call_takes_its_own_peers():
    """A cell pairs with vLLM timed in its own call, not a later call's figure for the same cell."""
    s12 = [R / "20261203-h200-s12-tune-bf16-deepseek.json", R / "20261203-h200-s12-peers-vllm-bf16.json"]
    s13 = [R / "20261203-h200-s13-peers-vllm-bf16.json", R / "20261203-h200-s13-tune-token-tile-deepseek.json"]
    out = _table("--call", *s12, "--call", *s13)
    # N = 64 was swept in the first call only: its vLLM figure (4270.6 µs), not the second's (4395.8)
    assert "| deepseek-v3 | bf16 | 64 | decode/swapab | 4341.9 | 0.95 | 0.98 |" in out
    assert "| deepseek-v3 | bf16 | 512 | decode/swapab/nt32 | 5544.2 | 1.05 | 1.00 |" in out  # the second call's


def test_stored_h200_peers_never_pair_with_another_gpus_cells():
    """An H100 sweep whose call timed no fp8 vLLM figure (deepseek-v3's quantization ran out of memory)
    shows "-", not the H200 baseline's figure against an H100 time."""
    call = [R / "20261206-h100-s47-serving-tune-deepseek-gpt-oss.json",
            R / "20261206-h100-s47-serving-peers-vllm-bf16-deepseek-gpt-oss.json"]
    out = _table("--call", *call)
    fp8 = [r for r in out.splitlines() if r.startswith("| deepseek-v3 | fp8_block |")]
    assert len(fp8) == 8 and all(r.endswith(" - |") for r in fp8)
    assert "| deepseek-v3 | bf16 | 16 | decode/swapab | 2735.7 |" in out and not any(
        r.endswith(" b |") for r in out.splitlines())


def test_against_an_earlier_sweep_counts_the_cells_that_stayed_and_names_the_rest():
    """Session 58's H100 sweep of mixtral-8x7b read against session 47's: its cells that moved past 0.6 %."""
    now = [R / "20261207-h100-s58-serving-tune-mixtral-8x7b.json"]
    out = _table(*now, "--against", R / "20261206-h100-s47-serving-tune-4-presets.json")
    tail = out[out.index("Against the earlier sweep"):].splitlines()
    assert tail[0] == "Against the earlier sweep: 11 of 16 cells within 0.6 %; beyond it:"
    assert "mixtral-8x7b fp8_block N=128: prefill 541.6 -> prefill 558.3 us (+3.1 %)" in tail
    assert len(tail) == 1 + 5
    wide = _table(*now, "--against", R / "20261206-h100-s47-serving-tune-4-presets.json", "--within", "5")
    assert wide.rstrip().endswith("Against the earlier sweep: 16 of 16 cells within 5 %; beyond it:")
