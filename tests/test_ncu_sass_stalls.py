"""scripts/ncu_sass_stalls.py's split of a kernel's source page at its last wgmma line (the w8a8
GEMM's epilogue share, DECISIONS "Next for #40"), on a small hand-made page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "ncu_sass_stalls.py"
    spec = importlib.util.spec_from_file_location("ncu_sass_stalls", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(addr: int, src: str, samples: int, executed: int) -> dict:
    return {"Address": f"{addr:x}", "Source": src, "Warp Stall Sampling (All Samples)": str(samples),
            "Instructions Executed": f"{executed:,}"}


def test_the_epilogue_share_is_what_follows_the_last_hgmma():
    ncu = _script()
    rows = [_row(0x40, "FMUL R1, R2, R3", 30, 4000), _row(0x10, "MOV R0, R1", 10, 1000),
            _row(0x30, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24", 20, 1000),
            _row(0x20, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", 20, 2000),
            _row(0x50, "STG.E.U16 [R4], R5", 20, 2000)]
    split = ncu.regions(rows)
    assert split["samples"] == pytest.approx((0.5, 0.5))  # 10 + 20 + 20 before 0x40, 30 + 20 from it
    assert split["executed"] == pytest.approx((0.4, 0.6))
    assert ncu.regions([_row(0x10, "FFMA R1, R2, R3, R4", 5, 5)]) is None


def test_address_blocks_group_the_samples_by_stretches_of_sass():
    ncu = _script()
    rows = [_row(0x1000, "A", 10, 5), _row(0x1010, "B", 30, 5), _row(0x5000, "C", 59, 7), _row(0x9000, "D", 1, 1)]
    blocks = ncu.address_blocks(rows, least=0.05)
    assert [(b, round(share, 2), ex) for b, share, ex in blocks] == [(0x0, 0.4, 10), (0x4000, 0.59, 7)]
