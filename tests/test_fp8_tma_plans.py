"""CPU tests of the w8a8 TMA grouped GEMM's dispatch (cuda/grouped_sm90_fp8_tma.cu): off by
default, on by CUPYMOE_SM90_FP8_VARIANT=tma or a tuning-table row, with the tiles, grids,
arguments, tensor maps and shared memory the kernel file expects."""

from __future__ import annotations

import re

import pytest

from cupymoe import bench, catalog as C, heuristics as HX, jit, testing, tma
from cupymoe.config import MoeConfig
from cupymoe.errors import OptionError
from cupymoe.forward_plan import FP8_MAPS, build_forward_plan, prefill_shape
from cupymoe.knobs import Knobs, Sm90Fp8
from cupymoe.plan import DeviceFacts, LayerOptions, Path, plan_layer
from cupymoe.tuning import Choice, parse_by_shape, shape_key

H200 = DeviceFacts.h200()
TMA = Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "tma"})
HOPPER_OPT_IN = 227 * 1024  # dynamic shared memory a block may opt in to


def _lp(cfg, knobs=TMA, fmt="fp8_block", arch="sm_90a", table=None, **options):
    shared = fmt if cfg.has_shared_expert else None
    return plan_layer(cfg, fmt, shared, arch, options=LayerOptions(**options), knobs=knobs,
                      table={} if table is None else table)


def _experts(plan):
    return [s for s in plan.launches if s.stage.value in ("gate_up", "down") and s.kernel.startswith("grouped_gemm")]


def test_the_knob_is_read_and_refused_by_name():
    assert Knobs().sm90_fp8_variant == Sm90Fp8.AUTO and TMA.sm90_fp8_variant == Sm90Fp8.TMA
    assert Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "tma64"}).sm90_fp8_variant == Sm90Fp8.TMA64
    with pytest.raises(OptionError, match="CUPYMOE_SM90_FP8_VARIANT='wide'"):
        Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "wide"})


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_off_by_default(preset):
    lp = _lp(bench.preset_config(preset), Knobs())
    assert lp.fp8_tma_ok and not lp.fp8_tma_chosen
    for n in (256, 4096, 16384):
        assert HX.sm90_fp8_variant(lp, n) == "cp_async"
        kernels = {s.kernel for s in _experts(build_forward_plan(lp, H200, n, Path.PREFILL).at(n))}
        assert kernels == {"grouped_gemm_sm90_fp8<0>", "grouped_gemm_sm90_fp8<1>"}, kernels


@pytest.mark.parametrize("preset, n", [("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 4096), ("deepseek-v3", 1024),
                                       ("qwen3-235b-a22b", 2048), ("mixtral-8x7b", 16384)])
def test_the_knob_names_the_kernels_with_their_tiles_grids_and_args(preset, n):
    """128-row tiles from the sort; gate/up ceil(I / 128) x 128-row tiles, down ceil(H / 256);
    384 threads; the cp.async kernel's arguments plus the maps."""
    cfg = bench.preset_config(preset)
    lp = _lp(cfg)
    assert lp.fp8_tma_chosen and HX.sm90_fp8_variant(lp, n) == "tma"
    plan = build_forward_plan(lp, H200, n, Path.PREFILL).at(n)
    gate_up, down = _experts(plan)
    assert gate_up.kernel == "grouped_gemm_sm90_fp8_tma<0>" and down.kernel == "grouped_gemm_sm90_fp8_tma<1>"
    bm, bn = C.SM90_FP8_TMA_TILE[:2]
    k = cfg.num_experts_per_tok
    tiles = C.max_tiles(n, k, lp.n_local, cfg.has_shared_expert, bm)
    assert gate_up.grid == (-(-lp.i_max // (bn // 2)), tiles) and down.grid == (-(-cfg.hidden_size // bn), tiles)
    for launch in (gate_up, down):
        assert launch.block == (C.SM90_FP8_TMA_THREADS,) and launch.smem == C.sm90_fp8_tma_smem_bytes()
        assert launch.args[-1].name == "maps" and launch.arg("maps") == FP8_MAPS
    sort = [s for s in plan.launches if s.kernel == "sort_scan"]
    assert [(s.arg("BM"), s.arg("BM2")) for s in sort] == [(bm, 0)]  # one tile list, of 128-row tiles
    # everything but the kernel, its tiles and the maps is the cp.async kernel's
    ref = build_forward_plan(_lp(cfg, Knobs()), H200, n, Path.PREFILL).at(n)
    rg, rd = _experts(ref)
    skip = ("num_tiles", "tile_info", "maps")
    for a, b in ((gate_up, rg), (down, rd)):
        assert [x for x in a.args if x.name not in skip] == [x for x in b.args if x.name not in skip]


def test_every_family_plans_and_names_compiled_kernels():
    """Tiny configs of every family (shared experts, biases, odd I): the forced variant where
    the TMA rows are whole 16-byte units, else the cp.async kernel."""
    names = set(jit.MODULES["grouped_sm90_fp8_tma"].names) | set(jit.MODULES["grouped_sm90_fp8"].names)
    for family in testing.FAMILIES:
        cfg = testing.tiny_config(family)
        lp = _lp(cfg)
        for n in (9, 67, 300, 1100):
            kernels = {s.kernel for s in _experts(build_forward_plan(lp, H200, n, Path.PREFILL).at(n))}
            assert kernels <= names, (family, n, kernels)
            assert any("_tma<" in k for k in kernels) == lp.fp8_tma_ok, (family, n, kernels)


def test_only_w8a8_on_sm90a_with_16_byte_rows():
    cfg = bench.preset_config("qwen3-30b-a3b")
    for lp in (_lp(cfg, arch="sm_80"), _lp(cfg, fp8_compute="w8a16"), _lp(cfg, fmt="bf16")):
        assert not lp.fp8_tma_ok and not lp.fp8_tma_chosen and HX.sm90_fp8_variant(lp, 4096) == "cp_async"
    odd = MoeConfig(**{**cfg.__dict__, "moe_intermediate_size": 776})  # 776 % 16 = 8: no TMA row pitch
    lp = _lp(odd)
    assert not lp.fp8_tma_ok and HX.sm90_fp8_variant(lp, 4096) == "cp_async"
    assert "grouped_gemm_sm90_fp8<0>" in {s.kernel for s in _experts(build_forward_plan(lp, H200, 4096,
                                                                                          Path.PREFILL).at(4096))}


def test_a_tuning_row_chooses_it_for_its_bucket_and_the_knob_overrides():
    cfg = bench.preset_config("qwen3-30b-a3b")
    key = (shape_key(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts,
                     cfg.num_experts_per_tok), "fp8_block:w8a8")
    table = parse_by_shape([dict(shape=key[0], format=key[1], n=4096, path="prefill", sm90_fp8="tma")])
    assert table[key] == ((4096, Choice("prefill", sm90_fp8="tma")),)
    lp = _lp(cfg, Knobs(), table=table)
    assert lp.fp8_tma_chosen
    assert HX.sm90_fp8_variant(lp, 4096) == "tma" and HX.sm90_fp8_variant(lp, 2049) == "tma"
    assert HX.sm90_fp8_variant(lp, 2048) == "cp_async" and HX.sm90_fp8_variant(lp, 4097) == "cp_async"
    assert prefill_shape(lp, H200, 3000) != prefill_shape(lp, H200, 2000)  # the buckets' plans differ
    off = _lp(cfg, Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "cp_async"}), table=table)
    assert not off.fp8_tma_chosen and HX.sm90_fp8_variant(off, 4096) == "cp_async"
    with pytest.raises(ValueError, match="sm90_fp8='wide'"):
        Choice("prefill", sm90_fp8="wide")


def test_shared_memory_fits_the_opt_in_limit():
    smem = C.sm90_fp8_tma_smem_bytes()
    assert smem <= HOPPER_OPT_IN <= H200.max_smem
    for m in (0, 1):  # the library opts each kernel in at load (else: invalid argument)
        assert jit.opt_in_smem(f"grouped_gemm_sm90_fp8_tma<{m}>", H200.max_smem) == smem
        assert jit.opt_in_smem(f"grouped_gemm_sm90_fp8<{m}>", H200.max_smem) == C.sm90_fp8_smem_bytes()


def _shape_constants(src: str) -> dict:
    """Fp8TmaShape<WGS>'s constants as the kernel file spells them (`WGS == 2 ? a : b`, `64 * WGS`, ...),
    evaluated for WGS 1 and 2: {wgs: {name: value}}."""
    body = re.search(r"struct Fp8TmaShape \{(.*?)\n\};", src, re.S).group(1)
    out = {}
    for wgs in (1, 2):
        consts = {}
        for name, expr in re.findall(r"static constexpr int (\w+) = ([^;]+);", body):
            py = re.sub(r"(.+?) \? (.+?) : (.+)", r"(\2 if \1 else \3)", expr)
            consts[name] = eval(py, {}, {"WGS": wgs})
        out[wgs] = consts
    return out


def test_kernel_file_and_catalog_agree():
    """The kernel's #defines and Fp8TmaShape against the catalog's tiles, threads and the maps of tma.FP8_MAPS."""
    src = (jit.kernel_dir() / "grouped_sm90_fp8_tma.cu").read_text()
    define = lambda name: int(re.search(rf"^#define {name} (\d+)", src, re.M).group(1))  # noqa: E731
    shapes = _shape_constants(src)
    assert (shapes[2]["BM"], define("F8T_BN"), define("F8T_BK"), shapes[2]["STAGES"]) == C.SM90_FP8_TMA_TILE
    assert shapes[2]["THREADS"] == C.SM90_FP8_TMA_THREADS
    for shape in C.FP8_TMA_SHAPES.values():
        k = shapes[shape.wgs]
        assert (k["BM"], k["STAGES"], k["THREADS"]) == (shape.bm, shape.stages, shape.threads)
        # blocks_per_sm blocks fit an SM: their shared memory, and the registers setmaxnreg shares out
        # (the consumers take what the producer gives back of the launch share, a multiple of 8)
        assert k["BLOCKS_PER_SM"] * (shape.smem_bytes() + 1024) <= 228 * 1024
        share = 65536 // k["BLOCKS_PER_SM"] // k["THREADS"] // 8 * 8
        assert 128 * shape.wgs * k["CONSUMER_REGS"] + 128 * k["PRODUCER_REGS"] <= share * k["THREADS"]
        assert k["PRODUCER_REGS"] % 8 == 0 and k["CONSUMER_REGS"] % 8 == 0
    assert define("F8T_BOX") == define("F8T_SUB") == tma.FP8_BOX_ROWS
    assert define("F8T_MAP_BYTES") == tma.MAP_BYTES
    maps = {m.group(1).lower(): int(m.group(2)) for m in re.finditer(r"#define F8T_MAP_(\w+) (\d+)", src)
            if m.group(1) != "BYTES"}
    assert maps == {name: i for i, name in enumerate(tma.FP8_MAPS)}


@pytest.mark.parametrize("preset, n", [("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 4096), ("deepseek-v3", 1024),
                                       ("mixtral-8x7b", 64)])
def test_tma64_names_its_form_with_64_row_tiles(preset, n):
    """CUPYMOE_SM90_FP8_VARIANT=tma64: <mode, false, 1> on the cp.async kernel's 64-row tile list,
    256 threads, two stages' shared memory; every other argument the cp.async kernel's."""
    cfg = bench.preset_config(preset)
    lp = _lp(cfg, Knobs.from_env({"CUPYMOE_SM90_FP8_VARIANT": "tma64"}))
    assert lp.fp8_tma_chosen and HX.sm90_fp8_variant(lp, n) == "tma64"
    plan = build_forward_plan(lp, H200, n, Path.PREFILL).at(n)
    gate_up, down = _experts(plan)
    assert gate_up.kernel == "grouped_gemm_sm90_fp8_tma<0, false, 1>"
    assert down.kernel == "grouped_gemm_sm90_fp8_tma<1, false, 1>"
    shape = C.FP8_TMA_SHAPES["tma64"]
    assert (shape.bm, shape.threads, shape.stages) == (64, 256, 2)
    tiles = C.max_tiles(n, cfg.num_experts_per_tok, lp.n_local, cfg.has_shared_expert, 64)
    assert gate_up.grid == (-(-lp.i_max // 128), tiles) and down.grid == (-(-cfg.hidden_size // 256), tiles)
    for launch in (gate_up, down):
        assert launch.block == (256,) and launch.smem == shape.smem_bytes() == jit.opt_in_smem(launch.kernel, 0)
        assert launch.arg("maps") == FP8_MAPS
    ref = build_forward_plan(_lp(cfg, Knobs()), H200, n, Path.PREFILL).at(n)
    for a, b in zip((gate_up, down), _experts(ref)):  # the cp.async kernel's tiles too
        assert [x for x in a.args if x.name != "maps"] == list(b.args)
    names = set(jit.MODULES["grouped_sm90_fp8_tma"].names)
    assert {gate_up.kernel, down.kernel, C.sm90_fp8_kernel(0, True, True, 1)} <= names


def test_the_forms_names_parse_back():
    for form, shape in C.FP8_TMA_SHAPES.items():
        for mode, keep in ((0, False), (1, False), (0, True)):
            assert C.sm90_fp8_tma_shape(C.sm90_fp8_kernel(mode, True, keep, shape.wgs)) == shape, form


class _Scratch:
    def __init__(self, sizes):
        self.sizes = sizes

    def ptr(self, name):
        return 0x10000 * (1 + sorted(self.sizes).index(name))

    def nbytes(self, name):
        return self.sizes[name]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-next-80b"])
def test_the_maps_read_e4m3_rows(preset, monkeypatch):
    """fp8_table: 64-row boxes of 128 codes; down's A over qact's rows with the I_max pitch;
    the routed experts' stacked weights; the shared expert's own (where it is fp8)."""
    cfg = bench.preset_config(preset)
    lp = _lp(cfg)
    seen = {}
    monkeypatch.setattr(tma, "encode", lambda m, box, what: seen.setdefault(what, (m, box)) and bytes(tma.MAP_BYTES))
    rows = 4096 * cfg.num_experts_per_tok
    ptrs = {p: [0x100000 * (i + 1) for i in range(lp.n_local + lp.has_shared)] for p in ("gate", "up", "down")}
    table = tma.fp8_table(lp, ptrs, _Scratch({"qact": rows * lp.i_max}))
    assert len(table) == tma.MAP_BYTES * len(tma.FP8_MAPS)
    H, I, n = cfg.hidden_size, cfg.moe_intermediate_size, lp.n_local
    assert all(box == tma.FP8_BOX_ROWS and m.elem == 1 for m, box in seen.values())
    a = seen["a_down"][0]
    assert (a.rows, a.cols, a.row_bytes) == (rows, I, lp.i_max)
    assert (seen["gate"][0].rows, seen["gate"][0].cols) == (n * I, H)
    assert (seen["down"][0].rows, seen["down"][0].cols, seen["down"][0].ptr) == (n * H, I, ptrs["down"][0])
    Is = cfg.shared_expert_intermediate_size
    assert ("shared_gate" in seen) == bool(Is)
    if Is:
        assert (seen["shared_down"][0].rows, seen["shared_down"][0].cols) == (H, Is)
        assert seen["shared_a_down"][0].cols == Is and seen["shared_gate"][0].ptr == ptrs["gate"][n]


def test_e4m3_matrices_need_16_byte_rows():
    tma.check_matrix(tma.Matrix2D(0x10000, 10, 48, elem=1), 64, "ok")
    with pytest.raises(tma.TmaError, match="pitch 40 bytes"):
        tma.check_matrix(tma.Matrix2D(0x10000, 10, 40, elem=1), 64, "e4m3")


def test_the_tune_candidates_offer_it_from_16_rows_an_expert():
    cfg = bench.preset_config("deepseek-v3")
    lp = _lp(cfg, Knobs())
    rows = lambda n: n * cfg.num_experts_per_tok / lp.n_local  # noqa: E731
    from cupymoe import tune

    for n in (256, 512, 1024, 4096):
        labels = [c.label() for c in tune.candidates(lp, n)]
        assert ("prefill/tma" in labels) == (rows(n) >= tune.MATH_MIN_ROWS), (n, labels)


def test_the_weight_maps_take_the_knobs_l2_promotion(monkeypatch):
    """CUPYMOE_WEIGHT_L2_PROMOTION reaches the weights' maps through the plan; the scratch maps
    (down's A) keep 256 bytes."""
    import dataclasses

    from cupymoe.knobs import Knobs, L2Promotion

    assert Knobs.from_env({"CUPYMOE_WEIGHT_L2_PROMOTION": "none"}).weight_l2_promotion == L2Promotion.NONE
    with pytest.raises(OptionError, match="CUPYMOE_WEIGHT_L2_PROMOTION='32'"):
        Knobs.from_env({"CUPYMOE_WEIGHT_L2_PROMOTION": "32"})
    cfg = bench.preset_config("qwen3-30b-a3b")
    assert _lp(cfg).weight_l2_promotion == L2Promotion.B128  # the default
    lp = dataclasses.replace(_lp(cfg), weight_l2_promotion=L2Promotion.B64)
    seen = {}
    monkeypatch.setattr(tma, "encode", lambda m, box, what: seen.setdefault(what, m) and bytes(tma.MAP_BYTES))
    ptrs = {p: [0x100000 * (i + 1) for i in range(lp.n_local + lp.has_shared)] for p in ("gate", "up", "down")}
    tma.fp8_table(lp, ptrs, _Scratch({"qact": 4096 * 8 * lp.i_max}))
    assert {seen[p].l2_promotion for p in ("gate", "up", "down")} == {"64"}
    assert seen["a_down"].l2_promotion == "256"
    seen.clear()
    tma.swapab_table(lp, ptrs)
    assert {m.l2_promotion for m in seen.values()} == {"64"}
