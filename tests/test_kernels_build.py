"""The CPU kernel-build check: every cuda/ module compiles through NVRTC, no GPU needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cupymoe import kernels


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("kcache")
    mp = pytest.MonkeyPatch()
    mp.setenv("CUPYMOE_CACHE_DIR", str(d))
    yield d
    mp.undo()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_kernel_compiles_without_spills(arch, cache):
    mods = kernels.build_all(arch)
    assert {m.module for m in mods} == set(kernels.modules_for(arch))
    assert ("grouped_sm90" in kernels.modules_for(arch)) == (arch == "sm_90a")
    for m in mods:
        res = {r.name: r for r in m.resources()}
        assert set(res) == set(kernels.MODULES[m.module].names), f"{m.module}: a kernel is missing from the report"
        for r in res.values():
            assert r.registers > 0, f"{arch} {r.name}: no ptxas report"
            assert (r.spill_stores, r.spill_loads) == (0, 0), f"{arch} {r.name} spills: {r}"
            assert r.stack_bytes == 0, f"{arch} {r.name} uses a stack frame (local memory): {r}"
            assert r.uses_wgmma == r.name.startswith(("grouped_gemm_sm90", "decode_wgmma_")), \
                f"{arch} {r.name}: wgmma {r.uses_wgmma}"
    print(f"\n{arch}\n" + kernels.format_report(mods))


def test_cache_hits_and_keys_on_arch(cache):
    a = kernels.compile_module("topk", "sm_90a")
    b = kernels.compile_module("topk", "sm_90a")
    assert b.from_cache and b.cubin == a.cubin and b.lowered == a.lowered
    c = kernels.compile_module("topk", "sm_80")
    assert c.cubin != a.cubin
    assert len(list(cache.glob("topk-sm_90a-*.cubin"))) == 1


def test_modules_compile_side_by_side_in_the_order_asked(monkeypatch):
    """compile_modules builds a module a thread (NVRTC releases the GIL): the modules come
    back in the order asked, each the same cubin as compile_module's alone; progress hears
    each once; CUPYMOE_BUILD_JOBS takes a positive count and names anything else."""
    names = ["repack", "topk", "router"]
    heard = []
    mods = kernels.compile_modules(names, "sm_80", use_cache=False, jobs=3,
                                   progress=lambda cm, seconds: heard.append((cm.module, seconds >= 0)))
    assert [m.module for m in mods] == names and sorted(heard) == sorted((n, True) for n in names)
    for m in mods:
        assert m.cubin == kernels.compile_module(m.module, "sm_80", use_cache=False).cubin, m.module
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("CUPYMOE_BUILD_JOBS", bad)
        with pytest.raises(ValueError, match=repr(bad)):
            kernels.compile_modules(names, "sm_80", use_cache=False)
    monkeypatch.setenv("CUPYMOE_BUILD_JOBS", "1")
    assert [m.module for m in kernels.compile_modules(names[:2], "sm_80", use_cache=False)] == names[:2]


def test_cli_prints_the_table_for_both_archs(cache):
    r = subprocess.run([sys.executable, "-m", "cupymoe", "kernels", "--arch", "sm_80", "sm_90a"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== sm_90a" in r.stdout and "decode_gate_up<4, 1, 0>" in r.stdout and "grouped_gemm<0, 128, 32, 3, 0>" in r.stdout and "SPILLS" not in r.stdout


def test_concurrent_processes_share_one_cache_safely(tmp_path):
    code = ("import sys; from cupymoe import kernels; "
            "m = kernels.compile_module('router', 'sm_90a'); print(len(m.cubin))")
    env = {**__import__("os").environ, "CUPYMOE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    sizes = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(sizes) == 1
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


@pytest.mark.parametrize("bad", ["sm_70", "compute_90", "90"])
def test_bad_arch_is_refused(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        kernels.parse_arch(bad)


def test_measurement_knobs_are_validated(monkeypatch):
    """CUPYMOE_SM90_VARIANT, CUPYMOE_SM90_DOWN_VARIANT, CUPYMOE_GEMM_BAND_COLS and
    CUPYMOE_MATH_ROWS (benchmark knobs) take only what they name, and name the bad value
    otherwise; unset, the measured defaults apply."""
    from cupymoe import kernels
    from cupymoe.layer import MATH_ROWS_PER_EXPERT, math_rows_per_expert

    for knob in ("CUPYMOE_SM90_VARIANT", "CUPYMOE_SM90_DOWN_VARIANT", "CUPYMOE_MATH_ROWS", "CUPYMOE_GEMM_BAND_COLS"):
        monkeypatch.delenv(knob, raising=False)
    assert kernels.sm90_variant() == "auto"
    # gate/up: gathering 128-row tiles below I = 1024, 192-row tiles from it
    assert kernels.sm90_variant_for(512) == kernels.sm90_variant_for(768) == "gather_wide"
    assert kernels.sm90_variant_for(1536) == kernels.sm90_variant_for(14336) == "tma_192"
    assert kernels.sm90_variant_for(kernels.GATHER_MAX_INTERMEDIATE - 1) == kernels.AUTO_GATHER_VARIANT
    assert kernels.sm90_variant_for(kernels.GATHER_MAX_INTERMEDIATE) == kernels.AUTO_TMA_VARIANT == "tma_192"
    # down: 192-row tiles but for long K (mixtral-8x7b's few long tiles)
    assert kernels.sm90_variant_for(512, 1) == kernels.sm90_variant_for(2880, 1) == "tma_192"
    assert kernels.sm90_variant_for(kernels.DOWN_192_MAX_INTERMEDIATE - 1, 1) == "tma_192"
    assert kernels.sm90_variant_for(kernels.DOWN_192_MAX_INTERMEDIATE, 1) == kernels.AUTO_LONG_K_VARIANT == "tma_wide"
    assert kernels.SM90_VARIANTS[kernels.AUTO_TMA_VARIANT].tma and kernels.SM90_VARIANTS["gather_wide"].gather
    # the gathering variants differ from their TMA twins in gate/up alone
    for g, t in (("gather_wide", "tma_wide"),):
        gv, tv = kernels.SM90_VARIANTS[g], kernels.SM90_VARIANTS[t]
        assert gv.gather and gv.tma and not tv.gather
        assert gv.kernel(1) == tv.kernel(1) and gv.kernel(0) == tv.kernel(0)[:-1] + ", 1>"
    monkeypatch.setenv("CUPYMOE_SM90_DOWN_VARIANT", "tma")
    assert kernels.sm90_variant_for(512, 1) == "tma" and kernels.sm90_variant_for(512, 0) == "gather_wide"
    monkeypatch.setenv("CUPYMOE_SM90_DOWN_VARIANT", "slim")
    with pytest.raises(ValueError, match="CUPYMOE_SM90_DOWN_VARIANT='slim'"):
        kernels.sm90_variant_for(512, 1)
    monkeypatch.delenv("CUPYMOE_SM90_DOWN_VARIANT")
    # the tile-order band: absent from the build options unless set, then a -D of its value
    assert kernels.gemm_band_cols() is None
    assert not any("GEMM_BAND_COLS" in o for o in kernels.compile_options("sm_90a"))
    monkeypatch.setenv("CUPYMOE_GEMM_BAND_COLS", "8")
    assert "-DGEMM_BAND_COLS=8" in kernels.compile_options("sm_90a")
    monkeypatch.setenv("CUPYMOE_GEMM_BAND_COLS", "0")
    with pytest.raises(ValueError, match="'0'"):
        kernels.gemm_band_cols()
    monkeypatch.delenv("CUPYMOE_GEMM_BAND_COLS")
    assert math_rows_per_expert("wgmma") == MATH_ROWS_PER_EXPERT["wgmma"] == 40
    assert math_rows_per_expert("mma") == 96
    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", "wide")
    assert kernels.sm90_kernel(1, kernels.sm90_variant()) == "grouped_gemm_sm90<1, 4, 1, 256>"
    assert kernels.sm90_variant_for(4096) == "wide"  # a named variant holds at every size
    assert kernels.sm90_variant_for(4096, 1) == "wide"  # and for down too
    monkeypatch.setenv("CUPYMOE_SM90_VARIANT", "fast")
    with pytest.raises(ValueError, match="'fast'"):
        kernels.sm90_variant()
    monkeypatch.setenv("CUPYMOE_MATH_ROWS", "48")
    assert math_rows_per_expert("mma") == math_rows_per_expert("wgmma") == 48
    monkeypatch.setenv("CUPYMOE_MATH_ROWS", "0")
    with pytest.raises(ValueError, match="'0'"):
        math_rows_per_expert("mma")
    for name, variant in kernels.SM90_VARIANTS.items():
        assert variant.smem_bytes() <= 227 * 1024, name  # Hopper's opt-in maximum
        assert all(variant.blocks_per_sm * variant.threads(m) <= 2048 for m in (0, 1, 2)), name


def test_decode_router_constants_and_knob(monkeypatch):
    """router_mma.cu's block shape is what the layer launches (its #defines against kernels'
    constants); CUPYMOE_DECODE_ROUTER takes auto, mma or cores and refuses anything else,
    naming the value."""
    import re

    src = (kernels.kernel_dir() / "router_mma.cu").read_text()

    def define(name):
        return int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))

    assert define("RM_COLS") == kernels.ROUTER_MMA_COLS
    assert define("RM_CLUSTER") == kernels.ROUTER_MMA_CLUSTER
    assert 2 * define("RM_KWARPS") * 32 == kernels.ROUTER_MMA_THREADS  # two column warps a K share
    assert kernels.ROUTER_MMA_COLS == 2 * 16 and kernels.ROUTER_MMA_TILES[-1] * 8 <= 64
    _check_choice_knob(monkeypatch, "CUPYMOE_DECODE_ROUTER", kernels.decode_router_mode, ("mma", "cores"), "tensor")


def test_fp4_tensor_core_decode_formats_and_knobs(monkeypatch):
    """Which fp4 formats decode on tensor cores: both, mxfp4 only while its scale bytes lie in
    FP4_MMA_MXFP4_SCALE_BYTES (the kernels scale weights by 2^-64 on the way), none with the
    measurement knob CUPYMOE_FP4_DECODE=cores; bad knob values are refused naming the value."""
    nv, mx = kernels.FORMAT_CODES["nvfp4"], kernels.FORMAT_CODES["mxfp4"]
    lo, hi = kernels.FP4_MMA_MXFP4_SCALE_BYTES
    assert kernels.fp4_decode_mma_formats("mma") == (nv, mx)  # no mxfp4 weights in the layer
    assert kernels.fp4_decode_mma_formats("mma", (lo, hi)) == (nv, mx)
    assert kernels.fp4_decode_mma_formats("mma", (lo - 1, hi)) == (nv,)
    assert kernels.fp4_decode_mma_formats("mma", (lo, hi + 1)) == (nv,)
    assert kernels.fp4_decode_mma_formats("cores", (lo, hi)) == ()
    for mode in ("auto", "wgmma"):  # every mode but "cores" decodes fp4 on tensor cores
        assert kernels.fp4_decode_mma_formats(mode, (lo, hi)) == (nv, mx)
    monkeypatch.delenv("CUPYMOE_FP4_DECODE", raising=False)
    assert kernels.fp4_decode_mode() == "auto"
    for v in ("mma", "wgmma", "cores"):
        monkeypatch.setenv("CUPYMOE_FP4_DECODE", v)
        assert kernels.fp4_decode_mode() == v
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", "tensor")
    with pytest.raises(ValueError, match="CUPYMOE_FP4_DECODE='tensor'"):
        kernels.fp4_decode_mode()
    monkeypatch.delenv("CUPYMOE_FP8_DECODE", raising=False)
    assert kernels.fp8_decode_mode() == "mma"
    monkeypatch.setenv("CUPYMOE_FP8_DECODE", "cuda")
    with pytest.raises(ValueError, match="CUPYMOE_FP8_DECODE='cuda'"):
        kernels.fp8_decode_mode()
    monkeypatch.setenv("CUPYMOE_FP4_DECODE", "tensor")
    with pytest.raises(ValueError, match="CUPYMOE_FP4_DECODE='tensor'"):
        kernels.fp4_decode_mode()
    monkeypatch.setenv("CUPYMOE_MMA_DECODE_BLOCKS_PER_SM", "0")
    with pytest.raises(ValueError, match="CUPYMOE_MMA_DECODE_BLOCKS_PER_SM='0'"):
        kernels.mma_decode_blocks_per_sm()
    _check_on_off_knob(monkeypatch, "CUPYMOE_MMA_DECODE_DOWN_PAIRS", kernels.mma_decode_down_pairs)


def test_router_split_depends_on_the_hidden_size_alone():
    """The CUDA-core router's warps per router row (router.cu) fix the order of a logit's
    sums, so they come from H alone (row invariance), and keep a lane's share of a row at
    1024 columns or fewer up to H = 8192 (one round of loads)."""
    for H in (64, 2048, 2880, 4096, 7168, 8192):
        split = kernels.router_split(H)
        assert split in kernels.ROUTER_SPLITS and -(-H // split) <= 1024
    assert kernels.router_split(2048) == 4 and kernels.router_split(7168) == 8


def test_pdl_launch_packs_the_driver_structures():
    """kernels.pack_launch builds cuLaunchKernelEx's CUlaunchConfig as cuda.h lays it out (the
    attribute an id padded to 8 bytes and a 64-byte value; the config 56 bytes) with the
    programmatic-stream-serialization attribute set, and passes each argument by address
    with its own C type."""
    import ctypes

    import numpy as np

    attr_t, cfg_t = kernels._launch_structs()
    assert ctypes.sizeof(attr_t) == 72 and ctypes.sizeof(cfg_t) == 56
    assert cfg_t.stream.offset == 32 and cfg_t.attrs.offset == 40 and cfg_t.num_attrs.offset == 48
    args = (np.uint64(0x1234_5678_9ABC), np.int32(-7), np.float32(1.5))
    cfg, params, keep = kernels.pack_launch((3, 2), (256,), args, stream_ptr=0xBEEF, shared_mem=4096)
    assert tuple(cfg.grid) == (3, 2, 1) and tuple(cfg.block) == (256, 1, 1)
    assert cfg.shared_mem == 4096 and cfg.stream == 0xBEEF and cfg.num_attrs == 1
    assert cfg.attrs[0].id == kernels.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert cfg.attrs[0].value.programmatic_stream_serialization_allowed == 1
    assert ctypes.c_uint64.from_address(params[0]).value == 0x1234_5678_9ABC
    assert ctypes.c_int32.from_address(params[1]).value == -7
    assert ctypes.c_float.from_address(params[2]).value == 1.5


def _check_on_off_knob(monkeypatch, name: str, read) -> None:
    """An on/off measurement knob: on unset, off at 0, and any other value refused by name."""
    monkeypatch.delenv(name, raising=False)
    assert read() is True
    monkeypatch.setenv(name, "0")
    assert read() is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name}='yes'"):
        read()


def _check_choice_knob(monkeypatch, name: str, read, choices: tuple[str, ...], bad: str) -> None:
    """A knob naming one of `choices`: "auto" unset, each choice read back, `bad` refused by name."""
    monkeypatch.delenv(name, raising=False)
    assert read() == "auto"
    for v in choices:
        monkeypatch.setenv(name, v)
        assert read() == v
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}='{bad}'"):
        read()


def test_pdl_knob(monkeypatch):
    _check_on_off_knob(monkeypatch, "CUPYMOE_PDL", kernels.pdl_mode)


def test_w8a8_decode_quantizes_x_beside_the_routing_only_at_a_row_or_two():
    """layer.route_lists_quantizes: decode_route_lists' idle warps (8 - N of them) quantize x
    where each takes at most ROUTE_LISTS_QUANT_UNITS 256-column units, else the router does
    (NOTES.md v29). The GPU tests' tiny configs (H = 96, 160) take route_lists' way at N = 1
    and 3 and the router's at 17 and 64."""
    from cupymoe.layer import ROUTE_LISTS_MAX_ROWS, route_lists_quantizes

    assert route_lists_quantizes(1, 2048) and route_lists_quantizes(2, 2048)  # qwen3-30b-a3b
    assert not route_lists_quantizes(3, 2048)
    assert route_lists_quantizes(1, 7168) and not route_lists_quantizes(2, 7168)  # deepseek-v3
    assert route_lists_quantizes(3, 96) and not route_lists_quantizes(7, 96)
    assert not route_lists_quantizes(ROUTE_LISTS_MAX_ROWS, 96)  # no idle warp


def test_wgmma_decode_constants_match_the_kernel_file(monkeypatch):
    """kernels.py sizes decode_wgmma_a8.cu's launches (threads, blocks, the ring's shared
    memory) from constants that must be the file's #defines; 8- and 16-row passes fit two
    blocks an SM up to H = 7168 (228 KB an SM, 1 KB of it reserved a block), as the file's
    register cap assumes, 32-row ones one. CUPYMOE_W8A8_DECODE takes only what it names."""
    import re

    src = (kernels.kernel_dir() / "decode_wgmma_a8.cu").read_text()
    defined = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (WG_\w+) (\d+)", src, re.M)}
    assert defined["WG_ROWS"] == kernels.WGMMA_DECODE_ROWS == 2 * kernels.WGMMA_DECODE_GATE_UP_COLUMNS
    assert defined["WG_STAGES"] == kernels.WGMMA_DECODE_STAGES
    assert defined["WG_KSUB"] == kernels.WGMMA_DECODE_KSUB
    assert defined["WG_THREADS"] == kernels.WGMMA_DECODE_THREADS
    assert defined["WG_BK"] == 128
    names = set(kernels.MODULES["decode_wgmma_a8"].names)
    assert names == {f"decode_wgmma_{m}_a8<{nt}>" for m in ("gate_up", "down") for nt in kernels.WGMMA_DECODE_TOKEN_TILES}
    sm_bytes = 228 * 1024
    for nt, blocks in ((8, 2), (16, 2), (32, 1)):
        for hidden in (2048, 7168):
            need = kernels.wgmma_decode_smem_bytes(nt, hidden // 128) + 1024
            assert blocks * need <= sm_bytes < (blocks + 1) * need, (nt, hidden, need)
    # 1024 to align, 3 stages of (128 + 16) rows of 2 x 128 codes, 18 scales a k128 step
    assert kernels.wgmma_decode_smem_bytes(16, 16) == 1024 + 3 * 144 * 256 + 18 * 16 * 4
    _check_choice_knob(monkeypatch, "CUPYMOE_W8A8_DECODE", kernels.w8a8_decode_mode, ("mma", "wgmma"), "tma")


def test_decode_list_builders_constants_match_the_kernel_files(monkeypatch):
    """The layer sizes decode_topk_lists' and decode_build_lists' launches (block, routing
    warps' scratch) from the .cu files' #defines; CUPYMOE_TOPK_LISTS takes only 0 or 1."""
    import re

    from cupymoe import layer

    common = (kernels.kernel_dir() / "decode_common.cuh").read_text()
    decode = (kernels.kernel_dir() / "decode.cu").read_text()
    assert int(re.search(r"^#define LISTS_THREADS (\d+)", common, re.M).group(1)) == layer.LISTS_THREADS
    assert int(re.search(r"^#define TOPK_LISTS_WARPS (\d+)", decode, re.M).group(1)) == layer.TOPK_LISTS_WARPS
    assert int(re.search(r"^#define TOPK_LISTS_MAX_R (\d+)", decode, re.M).group(1)) == layer.TOPK_LISTS_MAX_R
    assert layer.TOPK_LISTS_WARPS * 32 <= layer.LISTS_THREADS and layer.SMALL_SORT_PAIRS <= layer.LISTS_THREADS
    _check_on_off_knob(monkeypatch, "CUPYMOE_TOPK_LISTS", kernels.topk_lists_mode)


def test_wgmma_fp4_decode_constants_match_the_kernel_file():
    """kernels.py sizes decode_wgmma_fp4.cu's launches from constants that must be the
    file's #defines (its blocks: WGMMA_DECODE_ROWS weight rows, WGMMA_DECODE_THREADS threads,
    as the w8a8 ones); 8-row passes fit three blocks an SM (228 KB, 1 KB of it reserved a
    block), as the file's register cap assumes, 16-row ones two."""
    import re

    src = (kernels.kernel_dir() / "decode_wgmma_fp4.cu").read_text()
    defined = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (WF_\w+) (\d+)", src, re.M)}
    assert defined["WF_ROWS"] == kernels.WGMMA_DECODE_ROWS
    assert defined["WF_THREADS"] == kernels.WGMMA_DECODE_THREADS
    assert defined["WF_STAGES"] == kernels.WGMMA_FP4_DECODE_STAGES
    assert defined["WF_KSUB"] == kernels.WGMMA_FP4_DECODE_KSUB
    assert defined["WF_BK"] == 128
    assert "#define WF_MIN_BLOCKS(NTOK) ((NTOK) <= 8 ? 3 : 2)" in src
    names = set(kernels.MODULES["decode_wgmma_fp4"].names)
    codes = [kernels.FORMAT_CODES[f] for f in kernels.FP4_DECODE_FORMATS]
    assert names == {f"decode_wgmma_{m}_fp4<{c}, {nt}>" for m in ("gate_up", "down") for c in codes
                     for nt in kernels.WGMMA_FP4_DECODE_TOKEN_TILES}
    sm_bytes = 228 * 1024
    for c in codes:
        for nt, blocks in ((8, 3), (16, 2)):
            need = kernels.wgmma_fp4_decode_smem_bytes(c, nt) + 1024
            assert blocks * need <= sm_bytes < (blocks + 1) * need, (c, nt, need)
    # nvfp4, 8 rows: 1024 to align, 3 stages of 2 k steps of (8 rows x 256 bytes of bf16,
    # 128 rows x 64 bytes of codes, 128 rows x 8 scale bytes)
    assert kernels.wgmma_fp4_decode_smem_bytes(kernels.FORMAT_CODES["nvfp4"], 8) == 1024 + 3 * 2 * (2048 + 8192 + 1024)


def test_wgmma_gate_up_by_slot_where_little_is_copied_for_nothing():
    """The wgmma gate/up's grid by slot (first stages copied before the lists land) is taken
    where the measured gains were (qwen3-30b-a3b N = 32, 64) and not where it lost
    (deepseek-v3 N = 64) or where most experts sit idle (qwen3-30b-a3b N = 16)."""
    from cupymoe import bench, layer

    def waste(preset, n):
        cfg = bench.preset_config(preset)
        return layer.gate_up_ahead_waste(cfg.num_experts, cfg.num_experts, cfg.num_experts_per_tok, n,
                                         cfg.moe_intermediate_size)

    cap = layer.WGMMA_GATE_UP_AHEAD_MAX_WASTE
    assert waste("qwen3-30b-a3b", 64) < waste("qwen3-30b-a3b", 32) <= cap
    assert waste("qwen3-30b-a3b", 16) > cap and waste("deepseek-v3", 64) > cap
    # 128 experts, 8 a row, 64 rows: 128 (15/16)^64 idle, 12 blocks of 2 stages of 128 x 256 bytes
    assert waste("qwen3-30b-a3b", 64) == pytest.approx(128 * (15 / 16) ** 64 * 12 * 2 * 128 * 256)


@pytest.mark.parametrize("probe,names,no_spills", [
    # scripts/fp4_e4m3_decode_probe.py's kernels: its five modes on its default skeleton shapes
    ("fp4_e4m3_decode_probe", [f"fp4_probe<{m}, {s}>" for m in range(5)
                               for s in ("2, 3, 3, 128", "4, 2, 2, 128", "2, 4, 2, 128", "4, 3, 1, 128", "4, 2, 3, 64",
                                         "4, 3, 3, 64", "4, 4, 2, 64")], True),
    ("n1_stream_floor_probe", [], True),
    # v30's probe: its probe4 kernel spills 156 bytes here and as its script compiles it (sm_90, C++17)
    ("stream_pattern_probe", [], False),
])
def test_probe_sources_compile(probe, names, no_spills):
    """The measurement probes under scripts/ (their own .cu files, loaded by CuPy on the GPU)
    still compile for sm_90a with the kernels' headers; the fp4 and one-row probes without
    spills, which they would time along with what they measure."""
    from pathlib import Path

    nvrtc = kernels._nvrtc()
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{probe}.cu"
    prog = nvrtc.createProgram(path.read_text(), path.name, (), ())
    for n in names:
        nvrtc.addNameExpression(prog, n)
    try:
        nvrtc.compileProgram(prog, list(kernels.compile_options("sm_90a")))
    except nvrtc.NVRTCError as e:
        pytest.fail(f"{path.name}: {e}\n{nvrtc.getProgramLog(prog)}")
    log = nvrtc.getProgramLog(prog)
    assert [ln for ln in log.splitlines() if "Used" in ln and "registers" in ln], f"{path.name}: no ptxas report"
    spills = [ln for ln in log.splitlines() if "spill" in ln and "0 bytes spill stores, 0 bytes spill loads" not in ln]
    assert not (no_spills and spills), f"{path.name}: {spills}"
