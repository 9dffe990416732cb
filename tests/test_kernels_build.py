"""The CPU kernel-build check: every cuda/ module compiles through NVRTC, no GPU needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cupymoe import catalog as C
from cupymoe import jit
from cupymoe.catalog import WeightFormat
from cupymoe.knobs import Knobs
from cupymoe.plan import mma_decode_formats, sm90_variant_for
from cupymoe.catalog import GemmMode
from cupymoe.tuning import TUNING


@pytest.fixture(scope="session")
def cache():
    """The user's kernel cache: each arch is compiled once a run (and not again on the next)."""
    return jit.cache_dir()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_kernel_compiles_without_spills(arch, cache):
    mods = jit.compile_modules(jit.modules_for(arch), arch)
    assert {m.module for m in mods} == set(jit.modules_for(arch))
    assert ("grouped_sm90" in jit.modules_for(arch)) == (arch == "sm_90a")
    for m in mods:
        res = {r.name: r for r in m.resources()}
        assert set(res) == set(jit.MODULES[m.module].names), f"{m.module}: a kernel is missing from the report"
        for r in res.values():
            assert r.registers > 0, f"{arch} {r.name}: no ptxas report"
            assert (r.spill_stores, r.spill_loads) == (0, 0), f"{arch} {r.name} spills: {r}"
            assert r.stack_bytes == 0, f"{arch} {r.name} uses a stack frame (local memory): {r}"
            assert r.uses_wgmma == r.name.startswith(("grouped_gemm_sm90", "decode_wgmma_", "decode_swapab_")), \
                f"{arch} {r.name}: wgmma {r.uses_wgmma}"
    print(f"\n{arch}\n" + jit.format_report(mods))


def test_cache_hits_and_keys_on_arch(cache):
    a = jit.compile_module("topk", "sm_90a")
    b = jit.compile_module("topk", "sm_90a")
    assert b.from_cache and b.cubin == a.cubin and b.lowered == a.lowered
    c = jit.compile_module("topk", "sm_80")
    assert c.cubin != a.cubin
    stem = jit._cache_stem("topk", "sm_90a")[0]
    assert stem.with_suffix(".cubin").parent == cache and stem.with_suffix(".cubin").is_file()


def test_modules_compile_side_by_side_in_the_order_asked(monkeypatch):
    """compile_modules builds a module a thread (NVRTC releases the GIL): the modules come
    back in the order asked, each the same cubin as compile_module's alone; progress hears
    each once; CUPYMOE_BUILD_JOBS takes a positive count and names anything else."""
    names = ["repack", "topk", "router"]
    heard = []
    mods = jit.compile_modules(names, "sm_80", use_cache=False, jobs=3,
                                   progress=lambda cm, seconds: heard.append((cm.module, seconds >= 0)))
    assert [m.module for m in mods] == names and sorted(heard) == sorted((n, True) for n in names)
    for m in mods:
        assert m.cubin == jit.compile_module(m.module, "sm_80", use_cache=False).cubin, m.module
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("CUPYMOE_BUILD_JOBS", bad)
        with pytest.raises(ValueError, match=repr(bad)):
            jit.compile_modules(names, "sm_80", use_cache=False)
    monkeypatch.setenv("CUPYMOE_BUILD_JOBS", "1")
    assert [m.module for m in jit.compile_modules(names[:2], "sm_80", use_cache=False)] == names[:2]


def test_cli_prints_the_table_for_both_archs(cache):
    r = subprocess.run([sys.executable, "-m", "cupymoe", "kernels", "--arch", "sm_80", "sm_90a"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== sm_90a" in r.stdout and "decode_gate_up<4, 1, 0>" in r.stdout and "grouped_gemm<0, 128, 32, 3, 0>" in r.stdout and "SPILLS" not in r.stdout


def test_cli_refuses_an_arch_nvrtc_is_not_asked_for_in_one_line(capsys):
    """`kernels --arch foo` ended in a traceback; it is an OptionError, said in one line, exit 2."""
    from cupymoe.__main__ import main

    assert main(["kernels", "--arch", "sm_90a", "foo"]) == 2
    err = capsys.readouterr().err
    assert err == "cupymoe kernels: OptionError: arch='foo': expected a real architecture like sm_80 or sm_90a\n"


def test_concurrent_processes_share_one_cache_safely(tmp_path):
    code = ("import sys; from cupymoe import jit; "
            "m = jit.compile_module('router', 'sm_90a'); print(len(m.cubin))")
    env = {**__import__("os").environ, "CUPYMOE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    sizes = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(sizes) == 1
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"


@pytest.mark.parametrize("bad", ["sm_70", "compute_90", "90", "sm_99", "sm_80z", "sm_90z", "sm_80a", "sm_90f",
                                 "sm_88", "sm_1000z"])
def test_bad_arch_is_refused(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        jit.parse_arch(bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100a", "sm_100f", "sm_120",
                                  "sm_130"])  # past the newest known: a GPU the list predates, NVRTC decides
def test_real_archs_are_taken(arch):
    assert jit.parse_arch(arch) == (int(arch[3:].rstrip("af")), arch)


def test_measurement_knobs_pick_the_hopper_variants_and_math_rows():
    """CUPYMOE_SM90_VARIANT, CUPYMOE_SM90_DOWN_VARIANT and CUPYMOE_MATH_ROWS take only what they
    name; unset, the tuning table's choices apply; CUPYMOE_GEMM_BAND_COLS reaches the build options."""
    auto = TUNING.sm90_auto
    k = Knobs()
    # gate/up: gathering 128-row tiles below I = 1024, 192-row tiles from it
    assert sm90_variant_for(512, GemmMode.GATE_UP, k) == sm90_variant_for(768, GemmMode.GATE_UP, k) == "gather_wide"
    assert sm90_variant_for(1536, GemmMode.GATE_UP, k) == sm90_variant_for(14336, GemmMode.GATE_UP, k) == "tma_192"
    assert sm90_variant_for(auto.gather_max_intermediate - 1, GemmMode.GATE_UP, k) == auto.gate_up_gather
    # down: 192-row tiles but for long K (mixtral-8x7b's few long tiles)
    assert sm90_variant_for(2880, GemmMode.DOWN, k) == "tma_192"
    assert sm90_variant_for(auto.down_192_max_intermediate, GemmMode.DOWN, k) == auto.down_long_k == "tma_wide"
    V = TUNING.sm90_variants
    assert V[auto.gate_up].tma and V["gather_wide"].gather
    gv, tv = V["gather_wide"], V["tma_wide"]  # the gathering variant differs from its TMA twin in gate/up alone
    assert gv.kernel(1) == tv.kernel(1) and gv.kernel(0) == tv.kernel(0)[:-1] + ", 1>"
    down_tma = Knobs.from_env({"CUPYMOE_SM90_DOWN_VARIANT": "tma"})
    assert sm90_variant_for(512, GemmMode.DOWN, down_tma) == "tma"
    assert sm90_variant_for(512, GemmMode.GATE_UP, down_tma) == "gather_wide"
    with pytest.raises(ValueError, match="CUPYMOE_SM90_DOWN_VARIANT='slim'"):
        Knobs.from_env({"CUPYMOE_SM90_DOWN_VARIANT": "slim"})
    wide = Knobs.from_env({"CUPYMOE_SM90_VARIANT": "wide"})
    assert V[sm90_variant_for(4096, GemmMode.DOWN, wide)].kernel(1) == "grouped_gemm_sm90<1, 4, 1, 256>"
    with pytest.raises(ValueError, match="'fast'"):
        Knobs.from_env({"CUPYMOE_SM90_VARIANT": "fast"})
    assert not any("GEMM_BAND_COLS" in o for o in jit.compile_options("sm_90a", Knobs()))
    assert "-DGEMM_BAND_COLS=8" in jit.compile_options("sm_90a", Knobs.from_env({"CUPYMOE_GEMM_BAND_COLS": "8"}))
    for name in ("CUPYMOE_GEMM_BAND_COLS", "CUPYMOE_MATH_ROWS"):
        with pytest.raises(ValueError, match="'0'"):
            Knobs.from_env({name: "0"})
    assert TUNING.math_rows_per_expert == {"mma": 96, "wgmma": 40}
    for name, variant in V.items():
        assert variant.smem_bytes() <= 227 * 1024, name  # Hopper's opt-in maximum
        assert all(variant.blocks_per_sm * variant.threads(m) <= 2048 for m in (0, 1, 2)), name


def test_decode_router_constants_match_the_kernel_file():
    """router_mma.cu's block shape is what the plans launch (its #defines against the catalog's)."""
    import re

    src = (jit.kernel_dir() / "router_mma.cu").read_text()

    def define(name):
        return int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))

    assert define("RM_COLS") == C.ROUTER_MMA_COLS
    assert define("RM_CLUSTER") == C.ROUTER_MMA_CLUSTER
    assert 2 * define("RM_KWARPS") * 32 == C.ROUTER_MMA_THREADS  # two column warps a K share
    assert C.ROUTER_MMA_COLS == 2 * 16 and C.ROUTER_MMA_TILES[-1] * 8 <= 64


def test_fp4_tensor_core_decode_formats():
    """Which formats decode on tensor cores: both fp4 ones, mxfp4 only while its scale bytes lie in
    FP4_MMA_MXFP4_SCALE_BYTES (the kernels scale weights by 2^-64 on the way), none of them with
    CUPYMOE_FP4_DECODE=cores; fp8 unless CUPYMOE_FP8_DECODE=cores."""
    nv, mx, fp8 = WeightFormat.NVFP4, WeightFormat.MXFP4, WeightFormat.FP8_BLOCK
    lo, hi = C.FP4_MMA_MXFP4_SCALE_BYTES
    k = Knobs()
    assert mma_decode_formats(k, None) == (nv, mx, fp8)  # no mxfp4 weights in the layer
    assert mma_decode_formats(k, (lo, hi)) == (nv, mx, fp8)
    assert mma_decode_formats(k, (lo - 1, hi)) == mma_decode_formats(k, (lo, hi + 1)) == (nv, fp8)
    assert mma_decode_formats(Knobs.from_env({"CUPYMOE_FP4_DECODE": "cores"}), (lo, hi)) == (fp8,)
    assert mma_decode_formats(Knobs.from_env({"CUPYMOE_FP8_DECODE": "cores"}), (lo, hi)) == (nv, mx)
    for mode in ("mma", "wgmma"):  # every mode but "cores" decodes fp4 on tensor cores
        assert mma_decode_formats(Knobs.from_env({"CUPYMOE_FP4_DECODE": mode}), (lo, hi)) == (nv, mx, fp8)


def test_router_split_depends_on_the_hidden_size_alone():
    """The CUDA-core router's warps per router row (router.cu) fix the order of a logit's
    sums, so they come from H alone (row invariance), and keep a lane's share of a row at
    1024 columns or fewer up to H = 8192 (one round of loads)."""
    for H in (64, 2048, 2880, 4096, 7168, 8192):
        split = C.router_split(H)
        assert split in C.ROUTER_SPLITS and -(-H // split) <= 1024
    assert C.router_split(2048) == 4 and C.router_split(7168) == 8


def test_launches_pack_the_driver_structures():
    """A packed launch builds cuLaunchKernelEx's CUlaunchConfig as cuda.h lays it out (the attribute
    an id padded to 8 bytes and a 64-byte value; the config 56 bytes), with the
    programmatic-stream-serialization attribute where the plan asks for it."""
    import ctypes

    from cupymoe import launch

    assert ctypes.sizeof(launch._LaunchAttribute) == 72 and ctypes.sizeof(launch.LaunchConfig) == 56
    cfg_t = launch.LaunchConfig
    assert cfg_t.stream.offset == 32 and cfg_t.attrs.offset == 40 and cfg_t.num_attrs.offset == 48
    assert launch._PDL_ATTRIBUTE.id == launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert launch._PDL_ATTRIBUTE.value.programmatic_stream_serialization_allowed == 1


def test_w8a8_decode_quantizes_x_beside_the_routing_only_at_a_row_or_two():
    """layer.route_lists_quantizes: decode_route_lists' idle warps (8 - N of them) quantize x
    where each takes at most ROUTE_LISTS_QUANT_UNITS 256-column units, else the router does
    (benchmarks/DECISIONS.md). The GPU tests' tiny configs (H = 96, 160) take route_lists' way at N = 1
    and 3 and the router's at 17 and 64."""
    from cupymoe.catalog import ROUTE_LISTS_MAX_ROWS
    from cupymoe.heuristics import route_lists_quantizes

    assert route_lists_quantizes(1, 2048) and route_lists_quantizes(2, 2048)  # qwen3-30b-a3b
    assert not route_lists_quantizes(3, 2048)
    assert route_lists_quantizes(1, 7168) and not route_lists_quantizes(2, 7168)  # deepseek-v3
    assert route_lists_quantizes(3, 96) and not route_lists_quantizes(7, 96)
    assert not route_lists_quantizes(ROUTE_LISTS_MAX_ROWS, 96)  # no idle warp


def test_wgmma_decode_constants_match_the_kernel_file():
    """C.py sizes decode_wgmma_a8.cu's launches (threads, blocks, the ring's shared
    memory) from constants that must be the file's #defines; passes of every height fit two
    blocks an SM up to K = 14336 (228 KB an SM, 1 KB of it reserved a block), as the file's
    register cap assumes, and each ring keeps 64 KB of weights in flight (all stages but one)."""
    import re

    src = (jit.kernel_dir() / "decode_wgmma_a8.cu").read_text()
    defined = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (WG_\w+) (\d+)", src, re.M)}
    assert defined["WG_ROWS"] == C.WGMMA_DECODE_ROWS == 2 * C.WGMMA_DECODE_GATE_UP_COLUMNS
    assert "#define WG_KSUB(NTOK) ((NTOK) <= 16 ? 2 : 1)" in src and "#define WG_MIN_BLOCKS(NTOK) 2" in src
    assert "#define WG_STAGES(NTOK) ((NTOK) <= 16 ? 3 : 5)" in src
    assert C.WGMMA_DECODE_RING == {nt: ((3, 2) if nt <= 16 else (5, 1)) for nt in C.WGMMA_DECODE_TOKEN_TILES}
    assert defined["WG_THREADS"] == C.WGMMA_DECODE_THREADS
    assert defined["WG_BK"] == 128
    names = set(jit.MODULES["decode_wgmma_a8"].names)
    assert names == {f"decode_wgmma_{m}_a8<{nt}>" for m in ("gate_up", "down") for nt in C.WGMMA_DECODE_TOKEN_TILES}
    sm_bytes = 228 * 1024
    for nt in C.WGMMA_DECODE_TOKEN_TILES:
        for k in (2048, 7168, 14336):  # mixtral-8x7b's down: the longest K of the presets
            need = C.wgmma_decode_smem_bytes(nt, k // 128) + 1024
            assert 2 * need <= sm_bytes < 3 * need, (nt, k, need)
        assert C.wgmma_decode_ahead_bytes(nt) == 64 * 1024
    # 1024 to align, 3 stages of (128 + 16) rows of 2 x 128 codes, 2 weight scales a k128 step,
    # 3 slots of 16 rows' scales for 2 k steps
    assert C.wgmma_decode_smem_bytes(16, 16) == 1024 + 3 * 144 * 256 + 2 * 16 * 4 + 3 * 16 * 2 * 4


def test_decode_list_builders_constants_match_the_kernel_files():
    """The plans size decode_topk_lists' and decode_build_lists' launches (block, routing warps'
    scratch) from the .cu files' #defines."""
    import re

    layer = C

    common = (jit.kernel_dir() / "decode_common.cuh").read_text()
    decode = (jit.kernel_dir() / "decode.cu").read_text()
    assert int(re.search(r"^#define LISTS_THREADS (\d+)", common, re.M).group(1)) == layer.LISTS_THREADS
    assert int(re.search(r"^#define LISTS_MAX_ROUNDS (\d+)", common, re.M).group(1)) == layer.LISTS_MAX_ROUNDS
    assert layer.DECODE_SORT_PAIRS == layer.LISTS_MAX_ROUNDS * layer.LISTS_THREADS
    assert int(re.search(r"^#define TOPK_LISTS_WARPS (\d+)", decode, re.M).group(1)) == layer.TOPK_LISTS_WARPS
    assert int(re.search(r"^#define TOPK_LISTS_MAX_R (\d+)", decode, re.M).group(1)) == layer.TOPK_LISTS_MAX_R
    assert layer.TOPK_LISTS_WARPS * 32 <= layer.LISTS_THREADS and layer.SMALL_SORT_PAIRS <= layer.LISTS_THREADS


def test_wgmma_fp4_decode_constants_match_the_kernel_file():
    """C.py sizes decode_wgmma_fp4.cu's launches from constants that must be the
    file's #defines (its blocks: WGMMA_DECODE_ROWS weight rows, WGMMA_DECODE_THREADS threads,
    as the w8a8 ones); 8-row passes fit three blocks an SM (228 KB, 1 KB of it reserved a
    block), as the file's register cap assumes, 16-row ones two."""
    import re

    src = (jit.kernel_dir() / "decode_wgmma_fp4.cu").read_text()
    defined = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (WF_\w+) (\d+)", src, re.M)}
    assert defined["WF_ROWS"] == C.WGMMA_DECODE_ROWS
    assert defined["WF_THREADS"] == C.WGMMA_DECODE_THREADS
    assert defined["WF_STAGES"] == C.WGMMA_FP4_DECODE_STAGES
    assert defined["WF_KSUB"] == C.WGMMA_FP4_DECODE_KSUB
    assert defined["WF_BK"] == 128
    assert "#define WF_MIN_BLOCKS(NTOK) ((NTOK) <= 8 ? 3 : 2)" in src
    names = set(jit.MODULES["decode_wgmma_fp4"].names)
    codes = [int(f) for f in C.FP4_DECODE_FORMATS]
    assert names == {f"decode_wgmma_{m}_fp4<{c}, {nt}>" for m in ("gate_up", "down") for c in codes
                     for nt in C.WGMMA_FP4_DECODE_TOKEN_TILES}
    sm_bytes = 228 * 1024
    for c in codes:
        for nt, blocks in ((8, 3), (16, 2)):
            need = C.wgmma_fp4_decode_smem_bytes(c, nt) + 1024
            assert blocks * need <= sm_bytes < (blocks + 1) * need, (c, nt, need)
    # nvfp4, 8 rows: 1024 to align, 3 stages of 2 k steps of (8 rows x 256 bytes of bf16,
    # 128 rows x 64 bytes of codes, 128 rows x 8 scale bytes)
    assert C.wgmma_fp4_decode_smem_bytes(int(WeightFormat.NVFP4), 8) == 1024 + 3 * 2 * (2048 + 8192 + 1024)


def test_wgmma_gate_up_by_slot_where_little_is_copied_for_nothing():
    """The wgmma gate/up's grid by slot (first stages copied before the lists land) is taken
    where the measured gains were (qwen3-30b-a3b N = 32, 64) and not where it lost
    (deepseek-v3 N = 64) or where most experts sit idle (qwen3-30b-a3b N = 16)."""
    from cupymoe import bench
    from cupymoe.heuristics import gate_up_ahead_waste

    def waste(preset, n):
        cfg = bench.preset_config(preset)
        return gate_up_ahead_waste(cfg.num_experts, cfg.num_experts, cfg.num_experts_per_tok, n,
                                   -(-cfg.moe_intermediate_size // C.WGMMA_DECODE_GATE_UP_COLUMNS),
                                   C.wgmma_decode_ahead_bytes(8))

    cap = TUNING.gate_up_ahead_max_waste
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
    # the promotion schedules' probe: every (schedule, warpgroups, partner) it runs
    ("wgmma_promote_probe", [f"wgmma_promote_probe<{s}, {w}, {p}>" for s in range(3)
                             for w, p in ((1, "false"), (2, "false"), (2, "true"))], True),
    # v30's probe: its probe4 kernel spills 156 bytes here and as its script compiles it (sm_90, C++17)
    ("stream_pattern_probe", [], False),
])
def test_probe_sources_compile(probe, names, no_spills):
    """The measurement probes under scripts/ (their own .cu files, loaded by CuPy on the GPU)
    still compile for sm_90a with the kernels' headers; the fp4 and one-row probes without
    spills, which they would time along with what they measure."""
    from pathlib import Path

    nvrtc = jit._nvrtc()
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{probe}.cu"
    prog = nvrtc.createProgram(path.read_text(), path.name, (), ())
    for n in names:
        nvrtc.addNameExpression(prog, n)
    try:
        nvrtc.compileProgram(prog, list(jit.compile_options("sm_90a")))
    except nvrtc.NVRTCError as e:
        pytest.fail(f"{path.name}: {e}\n{nvrtc.getProgramLog(prog)}")
    log = nvrtc.getProgramLog(prog)
    assert [ln for ln in log.splitlines() if "Used" in ln and "registers" in ln], f"{path.name}: no ptxas report"
    spills = [ln for ln in log.splitlines() if "spill" in ln and "0 bytes spill stores, 0 bytes spill loads" not in ln]
    assert not (no_spills and spills), f"{path.name}: {spills}"
