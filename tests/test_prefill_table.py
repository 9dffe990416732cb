"""scripts/prefill_table.py: issue 40's cells judged against both bars, vLLM from the same call only."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_cells_judged_by_their_formats_bars(tmp_path):
    bench = _write(tmp_path / "bench.json", {"rows": [
        dict(shape="mixtral-8x7b", format="bf16", N=4096, us=4000.0, pct_of_floor=76.0),
        dict(shape="mixtral-8x7b", format="bf16", N=16384, us=19000.0, pct_of_floor=78.0),
        dict(shape="qwen3-30b-a3b", format="fp8_block", N=4096, us=600.0, pct_of_floor=20.0, pct_of_fp8_floor=61.0),
        dict(shape="deepseek-v3", format="fp8_block", N=4096, us=5000.0, pct_of_floor=40.0, pct_of_fp8_floor=62.0)]})
    peers = _write(tmp_path / "peer.json", {"rows": [
        dict(shape="mixtral-8x7b", N=4096, vllm_compute_only=5100.0),
        dict(shape="mixtral-8x7b", N=16384, vllm_compute_only=23000.0)]})
    peers8 = _write(tmp_path / "peer_fp8.json",
                    {"rows": [dict(shape="qwen3-30b-a3b", N=4096, vllm_fp8_gemms_only=990.0)]})
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prefill_table.py"), str(bench), "--peers",
                          str(peers), str(peers8)], capture_output=True, text=True, check=True).stdout
    assert "| mixtral-8x7b | bf16 | 4096 | 4000.0 | 76.0 | 1.27x | yes |" in out
    assert "| mixtral-8x7b | bf16 | 16384 | 19000.0 | 78.0 | 1.21x | no |" in out  # under 1.25x vLLM
    assert "| qwen3-30b-a3b | fp8_block | 4096 | 600.0 | 61.0 | 1.65x | yes |" in out  # the fp8 floor's percent
    assert "| deepseek-v3 | fp8_block | 4096 | 5000.0 | 62.0 | - | no |" in out  # no vLLM figure in the call
    assert "2 of 4 cells within both bars" in out
