"""CPU: the TMA tensor-map table's checks (cupymoe/tma.py); encoding itself needs the driver
and is exercised by the GPU tests."""

from __future__ import annotations

import pytest

from cupymoe import tma
from cupymoe.tuning import TUNING


def test_matrix_requirements_name_the_values():
    ok = tma.Matrix2D(0x10000, 1000, 96)
    tma.check_matrix(ok, 128, "ok")
    with pytest.raises(tma.TmaError, match="0x10008"):
        tma.check_matrix(tma.Matrix2D(0x10008, 10, 64), 128, "a")
    with pytest.raises(tma.TmaError, match="pitch 20 bytes"):
        tma.check_matrix(tma.Matrix2D(0x10000, 10, 10), 128, "b")
    with pytest.raises(tma.TmaError, match="of at least 192"):
        tma.check_matrix(tma.Matrix2D(0x10000, 10, 96, pitch=64), 128, "c")
    with pytest.raises(tma.TmaError, match="300 rows"):
        tma.check_matrix(ok, 300, "d")
    with pytest.raises(tma.TmaError, match="0 x 64"):
        tma.check_matrix(tma.Matrix2D(0x10000, 0, 64), 128, "e")
    # a matrix reading the leading columns of a wider buffer: the pitch is the buffer's
    assert tma.Matrix2D(0x10000, 10, 64, pitch=96).row_bytes == 192


def test_table_holds_every_kernel_map_in_order():
    assert len(tma.TMA_MAPS) == 15 and tma.TMA_MAPS[0] == "a_gate_up" and tma.TMA_MAPS[9] == "yw"
    assert tma.TMA_MAPS[10:] == ("lora_t_gu", "lora_t_down", "lora_b_gate", "lora_b_up", "lora_b_down")  # LoRA's
    table = tma.encode_table([None] * len(tma.TMA_MAPS))  # maps the layer never reads stay zero
    assert table == bytes(tma.MAP_BYTES * len(tma.TMA_MAPS))
    with pytest.raises(ValueError, match="the kernel reads 15"):
        tma.encode_table([None] * 8)


def test_kernel_and_python_agree_on_the_map_order():
    """cuda/grouped_sm90_tma.cu's TMA_MAP_* indices are TMA_MAPS' positions."""
    import re

    from cupymoe import jit

    src = (jit.kernel_dir() / "grouped_sm90_tma.cu").read_text()
    found = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define TMA_MAP_(\w+) (\d+)", src)
             if m.group(1) != "BYTES"}
    assert found == {name: i for i, name in enumerate(tma.TMA_MAPS)}


def test_kernel_and_python_agree_on_the_a_box_rows_and_the_producer_warps():
    """The layer encodes A's maps in boxes of C.TMA_A_BOX_ROWS rows, and the kernel
    counts TMA_SUB rows a box in the bytes its stages expect: the two must be one number.
    The layer launches the gathering gate/up with C.GATHER_WARPS producer warps, the
    kernel's launch bounds and barrier counts take GATHER_WARPS: one number too."""
    import re

    from cupymoe import catalog as C, jit

    src = (jit.kernel_dir() / "grouped_sm90_tma.cu").read_text()
    assert int(re.search(r"#define TMA_SUB (\d+)", src).group(1)) == C.TMA_A_BOX_ROWS
    assert int(re.search(r"#define GATHER_WARPS (\d+)", src).group(1)) == C.GATHER_WARPS
    v = TUNING.sm90_variants["gather_wide"]
    assert v.threads(0) == 256 + 32 * C.GATHER_WARPS and v.threads(1) == 288


def test_192_row_tiles_run_three_warpgroups_and_no_producer_warp():
    """tma_192: 192-row tiles (the sort builds them at v.bm), three consumer warpgroups and
    no producer warp (a thirteenth warp would cap a thread at 128 registers), its stages
    within Hopper's 227 KB; the kernel's launch bounds give WGS = 3 those 384 threads."""
    import re

    from cupymoe import catalog as C, jit

    v, wide = TUNING.sm90_variants["tma_192"], TUNING.sm90_variants["tma_wide"]
    assert (v.bm, wide.bm, TUNING.sm90_variants["twin"].bm) == (192, 128, C.SM90_BM)
    assert v.threads(0) == v.threads(1) == 384
    assert v.kernel(0) == "grouped_gemm_sm90_tma<0, 4, 256, 1, 0, 3>"
    assert v.kernel(1) == "grouped_gemm_sm90_tma<1, 4, 256, 1, 0, 3>"
    assert wide.kernel(1) == "grouped_gemm_sm90_tma<1, 4, 256, 1>"
    assert v.smem_bytes() == 4 * (192 + 256) * 64 * 2 + 16 * 4 + 1024 <= 227 * 1024
    src = (jit.kernel_dir() / "grouped_sm90_tma.cu").read_text()
    assert re.search(r"__launch_bounds__\(WGS \* 128 \+ \(WGS == 3 \? 0 :", src)


def test_encoding_without_a_driver_says_so():
    """Where libcuda is missing (CI), encoding a map is a TmaError naming the library; the
    checks above run before it, so a bad matrix is reported as such even there."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda.so.1 is present: the GPU tests encode real maps")
    except OSError:
        pass
    with pytest.raises(tma.TmaError, match="libcuda.so.1"):
        tma.encode(tma.Matrix2D(0x10000, 100, 64), 128, "x")
    with pytest.raises(tma.TmaError, match="not 16-byte aligned"):
        tma.encode(tma.Matrix2D(0x10001, 100, 64), 128, "x")
