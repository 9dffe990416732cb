"""CPU tests of the launch plans: every plan builds without a GPU, names only kernels that are
compiled, keeps its values of N exact across a prefill shape's row counts, and packs its
arguments once with the per-call values patched in place."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cupymoe import bench, heuristics as HX, jit, testing
from cupymoe.catalog import GemmMode
from cupymoe.errors import OptionError, PathUnavailableError
from cupymoe.forward_plan import build_forward_plan, prefill_buckets, prefill_shape
from cupymoe.knobs import Knobs
from cupymoe.launch import PackedPlan
from cupymoe.plan import (ArgType, Buf, CallValue, DeviceFacts, LayerOptions, Path, PerN, choose_path,
                          plan_layer)

H200 = DeviceFacts.h200()
A100 = DeviceFacts("sm_80", 108, 166912)


def _plan(cfg, fmt="bf16", dev=H200, shared=None, **options):
    shared = shared or (("bf16" if fmt == "bf16" else fmt) if cfg.has_shared_expert else None)
    return plan_layer(cfg, fmt, shared, dev.arch, options=LayerOptions(**options), knobs=Knobs())


CASES = [(fam, fmt) for fam in testing.FAMILIES for fmt in ("bf16", "fp8_block", "nvfp4", "mxfp4")]


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family, fmt", CASES)
def test_every_plan_builds_and_names_compiled_kernels(family, fmt, dev):
    cfg = testing.tiny_config(family)
    lp = _plan(cfg, fmt, dev, decode_max_tokens=64)
    names = {n for m in jit.modules_for(dev.arch) for n in jit.MODULES[m].names}
    for path, ns in ((Path.DECODE, (1, 3, 8, 17, 64)), (Path.ATOMIC, (1, 8)), (Path.PREFILL, (65, 300, 5000))):
        for n in ns:
            plan = build_forward_plan(lp, dev, n, path).at(n)
            assert plan.launches, (path, n)
            for launch in plan.launches:
                assert launch.kernel in names, launch.kernel
                assert all(isinstance(g, int) and g >= 1 for g in launch.grid), launch
                assert launch.smem <= dev.max_smem
                assert not launch.pdl or (path == Path.DECODE and dev.arch == "sm_90a")
                for a in launch.args:
                    assert isinstance(a.value, (int, float, Buf, CallValue)), a
            assert plan.describe().count("\n") == len(plan.steps)


def test_a_decode_plan_reads_as_its_launches():
    """qwen3-30b-a3b at one fp8 row: router, routing + lists in one launch, gate/up, down, reduce,
    the chain after the router by programmatic dependent launch."""
    cfg = bench.preset_config("qwen3-30b-a3b")
    plan = build_forward_plan(_plan(cfg, "fp8_block"), H200, 1, Path.DECODE)
    kernels = [launch.kernel.split("<")[0] for launch in plan.launches]
    assert kernels == ["router_logits_bf16", "decode_route_lists", "decode_mma_gate_up_a8", "decode_mma_down_a8",
                       "decode_reduce"]
    assert [launch.pdl for launch in plan.launches] == [False, True, True, True, True]
    route = plan.launches[1]
    assert route.arg("token_ids") == CallValue.TOKEN_IDS and route.arg("N") == 1
    assert plan.launches[-1].arg("out") == CallValue.OUTPUT


@pytest.mark.parametrize("preset, fmt, options", [
    ("qwen3-30b-a3b", "bf16", {}), ("deepseek-v3", "fp8_block", {}), ("qwen3-next-80b", "bf16", {}),
    ("mixtral-8x7b", "nvfp4", {}), ("gpt-oss-120b", "mxfp4", {}), ("qwen3-30b-a3b", "bf16", {"row_invariant": True}),
])
def test_a_prefill_plan_serves_every_row_count_of_its_shape_exactly(preset, fmt, options):
    """A prefill plan is built once a PrefillShape; its PerN values at N are what a plan built
    at N has (so a bucket's plan launches the very same kernels with the same arguments)."""
    cfg = bench.preset_config(preset, routed_only=False)
    lp = _plan(cfg, fmt, **options)
    lo = 1 if lp.row_invariant else lp.decode_max_tokens + 1
    shapes = [prefill_shape(lp, H200, n) for n in range(lo, 20001)]
    runs = [(lo, lo, shapes[0])]
    for n, shape in enumerate(shapes[1:], lo + 1):
        runs[-1:] = [(runs[-1][0], n, shape)] if shape == runs[-1][2] else [runs[-1], (n, n, shape)]
    assert prefill_buckets(lp, H200, lo, 20000) == runs  # each shape one run of row counts
    for first, last, shape in runs:
        plan = build_forward_plan(lp, H200, first, Path.PREFILL)
        for n in sorted({first, last, (first + last) // 2, min(last, first + 1), max(first, last - 1)}):
            assert plan.at(n) == build_forward_plan(lp, H200, n, Path.PREFILL).at(n), (shape, n)


def test_prefill_plans_carry_their_row_counts_as_values():
    cfg = bench.preset_config("qwen3-30b-a3b")
    plan = build_forward_plan(_plan(cfg), H200, 4096, Path.PREFILL)
    reduce = plan.launches[-1]
    assert reduce.kernel == "grouped_reduce" and isinstance(reduce.grid[0], PerN) and reduce.grid[0].fn(77) == 77
    assert plan.at(77).launches[-1].arg("N") == 77


def test_paths_by_rows_and_refusals():
    cfg = testing.tiny_config("qwen3_moe")
    lp = _plan(cfg, decode_max_tokens=6, atomic_max_tokens=4)
    assert [choose_path(lp, "auto", n) for n in (1, 6, 7)] == ["decode", "decode", "prefill"]
    with pytest.raises(PathUnavailableError, match="decode_max_tokens=6"):
        choose_path(lp, "decode", 7)
    with pytest.raises(PathUnavailableError, match="atomic_max_tokens"):
        choose_path(lp, "atomic", 5)
    with pytest.raises(PathUnavailableError, match="'warp'"):
        choose_path(lp, "warp", 1)
    ri = _plan(cfg, row_invariant=True)
    assert choose_path(ri, "auto", 1) == "prefill"
    with pytest.raises(PathUnavailableError, match="row_invariant=True"):
        choose_path(ri, "decode", 1)


def test_bad_options_are_refused_by_name():
    cfg = testing.tiny_config("qwen3_moe")
    with pytest.raises(OptionError, match="fp8_compute='w4a4'"):
        _plan(cfg, "fp8_block", fp8_compute="w4a4")
    with pytest.raises(OptionError, match="CUPYMOE_FP4_DECODE='tensor'"):
        Knobs.from_env({"CUPYMOE_FP4_DECODE": "tensor"})
    with pytest.raises(OptionError, match="CUPYMOE_PDL='2'"):
        Knobs.from_env({"CUPYMOE_PDL": "2"})


def test_fp4_down_blocks_take_two_tiles_where_a_wave_of_them_is_expected():
    """Two 128-row tiles a block on qwen3-30b-a3b's shape (I = 768: three ring stages) from the
    rows whose expected experts give a wave of 3 blocks on 132 SMs, one below and on deepseek-v3's
    (I = 2048: eight stages); CUPYMOE_FP4_DOWN_TILES forces a count where it divides H / 128."""
    def tiles(preset, n, n_local=None, env=None):
        cfg = bench.preset_config(preset)
        lp = plan_layer(cfg, "nvfp4", None, "sm_90a", n_local=n_local, knobs=Knobs.from_env(env or {}))
        return HX.fp4_down_tiles(lp, H200, n)

    assert [tiles("qwen3-30b-a3b", n) for n in (1, 4, 8, 16, 64)] == [1, 1, 2, 2, 2]
    assert [tiles("deepseek-v3", n) for n in (1, 8, 64)] == [1, 1, 1]
    assert tiles("qwen3-30b-a3b", 8, n_local=64) == 1  # half the experts on this rank
    assert tiles("qwen3-30b-a3b", 1, env={"CUPYMOE_FP4_DOWN_TILES": "4"}) == 4
    assert tiles("qwen3-30b-a3b", 64, env={"CUPYMOE_FP4_DOWN_TILES": "3"}) == 1  # 3 does not divide 16


def test_w8a8_down_blocks_take_the_knobs_tiles_where_they_divide_h():
    """CUPYMOE_A8_DOWN_TILES: decode_wgmma_down_a8's blocks take that many 128-row tiles where the
    count divides H / 128 (H a multiple of 128: gpt-oss-120b's 2880 is not), else one; the grid
    shrinks by it and the shared memory holds each tile's scales."""
    from cupymoe import catalog as C

    def down(preset, env=None):
        cfg = bench.preset_config(preset)
        lp = plan_layer(cfg, "fp8_block", None, "sm_90a", knobs=Knobs.from_env(env or {}))
        return HX.w8a8_decode_kernel(lp, H200, "down", 2.0, 64, 64)

    assert down("qwen3-30b-a3b", {"CUPYMOE_A8_DOWN_TILES": "1"}).blocks == 16
    assert down("qwen3-30b-a3b", {"CUPYMOE_A8_DOWN_TILES": "2"}).blocks == 8
    assert down("qwen3-30b-a3b", {"CUPYMOE_A8_DOWN_TILES": "3"}).blocks == 16  # 3 does not divide 16
    four = down("mixtral-8x7b", {"CUPYMOE_A8_DOWN_TILES": "4"})
    assert four.blocks == 8 and four.smem == C.wgmma_decode_smem_bytes(8, 14336 // 128, 4)
    assert down("gpt-oss-120b", {"CUPYMOE_A8_DOWN_TILES": "2"}).blocks == 23
    assert C.wgmma_decode_smem_bytes(8, 6, 4) - C.wgmma_decode_smem_bytes(8, 6) == 2 * 6 * 4


def test_w8a8_down_blocks_take_four_or_two_tiles_where_waves_of_them_are_expected():
    """By default decode_wgmma_down_a8's blocks take the most of 4 and 2 tiles whose grid over the
    experts the rows are expected to choose still holds a8_down_tiles_min_waves waves, where I is
    a few ring stages: qwen3-30b-a3b (I = 768: three stages) 2 at 8-16 rows and 4 from 32,
    qwen3-next-80b (I = 512) 4 from 16; one tile where I is longer (qwen3-235b-a22b, deepseek-v3,
    mixtral-8x7b) or H is no multiple of 128 (gpt-oss-120b), or with half the experts on a rank."""
    def tiles(preset, n, n_local=None):
        lp = plan_layer(bench.preset_config(preset), "fp8_block", None, "sm_90a", n_local=n_local, knobs=Knobs())
        return HX.a8_down_tiles(lp, H200, n)

    assert [tiles("qwen3-30b-a3b", n) for n in (1, 4, 8, 16, 32, 128)] == [1, 1, 2, 2, 4, 4]
    assert [tiles("qwen3-next-80b", n) for n in (4, 8, 16, 64)] == [1, 2, 4, 4]
    assert tiles("qwen3-30b-a3b", 16, n_local=64) == 1
    for preset in ("qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b", "gpt-oss-120b"):
        assert tiles(preset, 64) == 1, preset


def test_decode_routing_takes_one_launch_while_every_row_has_a_warp():
    """The decode path routes and builds the expert lists in one launch up to 8 rows
    (decode_route_lists), then up to 32 (decode_topk_lists, a warp a row, its scratch sized by the
    launch's rows and opted in past 48 KB: deepseek-v3's 256-wide router at 32 rows), and in two past
    that (topk_route, decode_build_lists); a router wider than 256 (qwen3-next-80b's 512) takes two."""
    from cupymoe import catalog as C

    def routing(preset, n):
        lp = plan_layer(bench.preset_config(preset), "bf16", None, "sm_90a", knobs=Knobs())
        steps = build_forward_plan(lp, H200, n, Path.DECODE).at(n).launches
        return [(s.kernel.split("<")[0], s.smem) for s in steps if s.stage.value in ("topk", "sort")]

    assert [k for k, _ in routing("qwen3-30b-a3b", 8)] == ["decode_route_lists"]
    for n in (9, 17, 32):
        (kernel, smem), = routing("qwen3-30b-a3b", n)
        assert kernel == "decode_topk_lists" and smem == C.topk_lists_smem_bytes(n, 8, 128, 128), n
    assert [k for k, _ in routing("qwen3-30b-a3b", 33)] == ["topk_route", "decode_build_lists"]
    (kernel, smem), = routing("deepseek-v3", 32)
    assert kernel == "decode_topk_lists" and C.STATIC_SMEM_LIMIT < smem <= H200.max_smem
    assert [k for k, _ in routing("qwen3-next-80b", 16)] == ["topk_route", "decode_build_lists"]


@pytest.mark.parametrize("knob", ["auto", "split"])
def test_split_router_runs_where_topk_route_sums_its_copies(knob):
    """Past decode_topk_lists' 32 rows the tensor-core router is router_logits_split (K over
    router_split_copies(H) blocks, a logits copy each) and topk_route sums that many copies; below,
    where the one-launch routers read one copy, the cluster router; CUPYMOE_DECODE_ROUTER=mma keeps
    the cluster router at every N, and auto the CUDA-core one below the split form's multiply-adds
    (mixtral-8x7b's 8-wide router at 64 rows; qwen3-next-80b's 512-wide one, routed by topk_route, below 8 rows)."""
    from cupymoe import catalog as C
    from cupymoe.knobs import DecodeRouter

    def first_two(preset, n, router=DecodeRouter(knob)):
        lp = plan_layer(bench.preset_config(preset), "bf16", None, "sm_90a", knobs=Knobs(decode_router=router))
        return build_forward_plan(lp, H200, n, Path.DECODE).at(n).launches[:2]

    router, topk = first_two("qwen3-30b-a3b", 64)
    assert C.router_split_copies(2048) == 4 and C.router_split_copies(96) == 1
    assert (router.kernel, router.grid) == ("router_logits_split<4>", (4, 4, 2))
    assert topk.kernel == "topk_route<0>" and topk.arg("splits") == 4
    router, topk = first_two("qwen3-30b-a3b", 32)  # (auto: R N H under the tensor cores' multiply-adds)
    assert router.kernel == ("router_logits_mma<4>" if knob == "split" else "router_logits_bf16<8, 4>")
    assert topk.kernel == "decode_topk_lists<0>"
    router, topk = first_two("qwen3-30b-a3b", 64, DecodeRouter.MMA)
    assert router.kernel == "router_logits_mma<8>" and topk.arg("splits") == 1
    if knob == "auto":  # the split form from its own multiply-adds (2^23), below the cluster router's
        assert first_two("qwen3-30b-a3b", 33)[0].kernel.startswith("router_logits_split<")
        assert first_two("mixtral-8x7b", 64)[0].kernel.startswith("router_logits_bf16<")
        assert first_two("qwen3-next-80b", 9)[0].kernel.startswith("router_logits_split<")
        assert first_two("qwen3-next-80b", 7)[0].kernel.startswith("router_logits_bf16<")


def test_w8a8_decode_takes_wgmma_from_the_measured_waves():
    """decode_wgmma_a8.cu where the gate/up grid holds wgmma_decode_min_waves waves of two blocks an
    SM, decode_mma.cu's _a8 kernels below: deepseek-v3 from N = 2 (512 blocks), qwen3-30b-a3b from 8."""
    def kernel(preset, n):
        cfg = bench.preset_config(preset)
        lp = _plan(cfg, "fp8_block")
        E, k = cfg.num_experts, cfg.num_experts_per_tok
        found = HX.w8a8_decode_kernel(lp, H200, "gate_up", max(1.0, 2.0 * n * k / E), min(E, n * k))
        return found.name.split("<")[0] if found else "mma"

    assert [kernel("deepseek-v3", n) for n in (1, 2, 4)] == ["mma", "decode_wgmma_gate_up_a8", "decode_wgmma_gate_up_a8"]
    assert [kernel("qwen3-30b-a3b", n) for n in (1, 4, 8)] == ["mma", "mma", "decode_wgmma_gate_up_a8"]


def test_router_tiles_by_rows_and_width():
    """The prefill router takes 128 x 128 tiles from 1024 rows unless they leave half the SMs idle."""
    narrow, wide = bench.preset_config("qwen3-30b-a3b"), bench.preset_config("qwen3-next-80b")
    assert HX.router_config(_plan(narrow), H200, 4096) == "stream"  # 32 tiles of 128 x 128
    assert HX.router_config(_plan(wide), H200, 4096) == "math"
    assert HX.router_config(_plan(wide), H200, 1023) == "stream"
    assert HX.router_splits(_plan(narrow), H200, 64) == 4 and HX.router_splits(_plan(narrow, row_invariant=True),
                                                                                H200, 64) == 1


def test_hopper_gemm_variants_follow_the_tuning_table():
    cfg = bench.preset_config("deepseek-v3")
    lp = _plan(cfg)
    assert lp.sm90[GemmMode.GATE_UP].wgs == 3 and lp.sm90[GemmMode.DOWN].wgs == 3 and lp.tma
    assert not _plan(cfg, "nvfp4").tma  # quantized experts take twin's cp.async tiles
    assert _plan(cfg, dev=A100).fp8_compute is None and not _plan(cfg, "fp8_block", dev=A100).w8a8
    assert _plan(bench.preset_config("qwen3-30b-a3b")).gathers_rows is False  # gather_wide: no xg


class _Lib:
    def __init__(self):
        self.asked = []

    def pointer(self, name):
        self.asked.append(name)
        return 0x1000 + len(self.asked)


def _cells(packed, launch_index):
    """The argument values one packed launch would pass, read back through its parameter array."""
    _, kind, payload = [s for s in packed.steps if s[1] == "launch"][launch_index]
    launch = packed.plan.launches[launch_index]
    params = (ctypes.c_void_p * len(launch.args)).from_address(payload[2])
    types = {ArgType.U64: ctypes.c_uint64, ArgType.I32: ctypes.c_int32, ArgType.F32: ctypes.c_float}
    return {a.name: types[a.type].from_address(params[i]).value for i, a in enumerate(launch.args)}


def test_packed_plans_patch_the_call_values_and_the_row_count_in_place():
    cfg = bench.preset_config("qwen3-30b-a3b")
    lp = _plan(cfg)
    plan = build_forward_plan(lp, H200, 4096, Path.PREFILL)
    addresses = {}

    def resolve(buf):
        return addresses.setdefault(str(buf), 0x10_0000 * (len(addresses) + 1))

    lib = _Lib()
    packed = PackedPlan(plan, resolve, lib.pointer)
    assert len(lib.asked) == len(plan.launches)
    packed.prepare(0xA000, 0xB000, 0, 3000, 0x77)
    reduce = _cells(packed, len(plan.launches) - 1)
    assert reduce["x"] == 0xA000 and reduce["out"] == 0xB000 and reduce["N"] == 3000
    assert reduce["yw"] == addresses["scratch.yw"]
    packed.prepare(0xA100, 0xB100, 0, 1500, 0x77)
    reduce = _cells(packed, len(plan.launches) - 1)
    assert reduce["x"] == 0xA100 and reduce["N"] == 1500
    router = _cells(packed, 0)
    assert router["x"] == 0xA100 and router["P"] == 1500  # one cell every launch shares


@pytest.mark.parametrize("options, message", [
    (dict(decode_max_tokens=0), r"decode_max_tokens=0: must be a whole number of rows, at least 1"),
    (dict(decode_max_tokens=2.7), r"decode_max_tokens=2.7: must be a whole number"),
    (dict(atomic_max_tokens=-3), r"atomic_max_tokens=-3: must be a whole number of rows, at least 0"),
    (dict(decode_max_tokens=True), r"decode_max_tokens=True"),
    (dict(decode_max_tokens=8, atomic_max_tokens=100), r"atomic_max_tokens=100 exceeds decode_max_tokens=8"),
    (dict(row_invariant="no"), r"row_invariant='no': must be True or False"),
    (dict(all_reduce=1), r"all_reduce=1: must be True or False"),
])
def test_layer_options_out_of_range_are_refused_by_name(options, message):
    """MoeLayer's plan options are refused, naming the value, where they used to be clamped (0 rows ->
    1, 2.7 -> 2, atomic past decode -> decode's) or read as truthy ('no' -> True)."""
    from cupymoe.errors import OptionError
    from cupymoe.plan import LayerOptions

    with pytest.raises(OptionError, match=message):
        LayerOptions(**options)
    assert LayerOptions(decode_max_tokens=np.int64(8), atomic_max_tokens=0).decode_max_tokens == 8


@pytest.mark.parametrize("env, fmt, arch, says", [
    ({"CUPYMOE_DECODE_KERNEL": "swapab"}, "nvfp4", "sm_90a", "CUPYMOE_DECODE_KERNEL=swapab: the swap-AB decodes serve"),
    ({"CUPYMOE_DECODE_ROUTER": "mma"}, "bf16", "sm_80", "CUPYMOE_DECODE_ROUTER=mma: the tensor-core router is sm_90a's"),
    ({"CUPYMOE_DECODE_ROUTER": "split"}, "bf16", "sm_80", "CUPYMOE_DECODE_ROUTER=split: the tensor-core router is"),
    ({"CUPYMOE_FP4_DECODE": "wgmma"}, "nvfp4", "sm_80", "CUPYMOE_FP4_DECODE=wgmma: decode_wgmma_fp4 needs sm_90a"),
    ({"CUPYMOE_SM90_FP8_VARIANT": "tma"}, "bf16", "sm_90a", "CUPYMOE_SM90_FP8_VARIANT=tma: the layer's w8a8 GEMMs"),
    ({"CUPYMOE_FP4_DOWN_TILES": "2"}, "nvfp4", "sm_80", "CUPYMOE_FP4_DOWN_TILES=2: the fp4 wgmma decode does not run"),
    ({"CUPYMOE_A8_DOWN_TILES": "3"}, "fp8_block", "sm_90a", "CUPYMOE_A8_DOWN_TILES=3: it does not divide H / 128"),
])
def test_a_forced_knob_the_layer_cannot_take_is_logged(env, fmt, arch, says, caplog):
    """A knob forcing a kernel the layer has not falls back to what serves it (a sweep sets knobs over
    several presets): the plan logs a warning naming the knob and what runs instead; a knob that
    applies, and no knob, log nothing."""
    from cupymoe import plan as plan_mod
    from cupymoe.knobs import Knobs

    cfg = bench.preset_config("qwen3-30b-a3b")
    plan_mod._LOGGED.clear()  # each note is logged once a process
    with caplog.at_level("WARNING", logger="cupymoe.plan"):
        plan_layer(cfg, fmt, None, arch, knobs=Knobs.from_env(env))
        plan_layer(cfg, fmt, None, arch, knobs=Knobs.from_env(env))
    said = [r.getMessage() for r in caplog.records if says in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("WARNING", logger="cupymoe.plan"):
        plan_layer(cfg, "fp8_block", None, "sm_90a", knobs=Knobs.from_env({"CUPYMOE_A8_DOWN_TILES": "4"}))
        plan_layer(cfg, fmt, None, arch, knobs=Knobs())
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family, fmt", CASES)
def test_every_tiled_launch_s_grid_stays_within_its_tile_list(family, fmt, dev):
    """A grouped GEMM may read its M-tile's tile_info entry before it tests the tile count
    (cuda/gemm_common.cuh gemm_tile_at, EARLY): every M-tile its grid can start lies within the
    buffer, at every row count up to the layer's max_tokens."""
    from cupymoe.workspace import layer_need

    cfg = testing.tiny_config(family)
    lp = _plan(cfg, fmt, dev, decode_max_tokens=64)
    max_tokens = 5000
    placements = layer_need(lp, max_tokens)[0].placements
    seen = 0
    for n, path in [(n, Path.PREFILL) for n in (1, 8, 65, 300, 1023, 4096, max_tokens)] + \
            [(n, choose_path(lp, "auto", n)) for n in (1, 8, 64)]:
        plan = build_forward_plan(lp, dev, n, path).at(n)
        for launch in plan.launches:
            names = {a.name for a in launch.args}
            if not names >= {"act_code", "tile_info"} or isinstance(launch.arg("tile_info"), int):
                continue
            buf = launch.arg("tile_info")
            assert isinstance(buf, Buf), launch
            assert launch.grid[1] * 16 <= placements[buf.name].nbytes, (n, launch.kernel, launch.grid)
            seen += 1
    assert seen >= 2  # gate/up and down at least at the prefill row counts


def test_forced_swapab_decode_builds_where_the_table_names_prefill_variants():
    """CUPYMOE_DECODE_KERNEL=swapab leaves the table's paths to the rule up to SWAPAB_MAX_ROWS rows; a
    bucket there that chose a prefill GEMM variant (mixtral-8x7b bf16: tma_wide) loses it with its path,
    where it raised a ValueError building the layer."""
    from cupymoe import catalog as C

    cfg = bench.preset_config("mixtral-8x7b")
    plain = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs())
    assert any(c.sm90_gate_up and b <= C.SWAPAB_MAX_ROWS for b, c in plain.tuned)  # the case this covers
    lp = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "swapab"}))
    for b, c in lp.tuned:
        if b <= C.SWAPAB_MAX_ROWS:
            assert c.path is None and c.sm90_gate_up is None and c.sm90_down is None, (b, c)
    assert {b: c for b, c in lp.tuned if b > C.SWAPAB_MAX_ROWS} == {b: c for b, c in plain.tuned
                                                                     if b > C.SWAPAB_MAX_ROWS}
