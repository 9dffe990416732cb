"""CPU tests of the swap-AB w8a8 decode's dispatch (cuda/decode_swapab_fp8_sm90.cu): fp8-block
experts as w8a8 take it by CUPYMOE_DECODE_KERNEL=swapab or a tuning-table row, with the grids,
arguments (the w8a8 decode kernels' own, then the maps) and shared memory the kernel file
expects, and every kernel opted in to its ring at load."""

from __future__ import annotations

import re

import pytest

from _kernel_source import define as source_define, map_indices
from cupymoe import bench, catalog as C, heuristics as HX, jit, testing
from cupymoe.catalog import WeightFormat
from cupymoe.forward_plan import SWAPAB_MAPS, build_forward_plan
from cupymoe.knobs import Knobs
from cupymoe.plan import DeviceFacts, LayerOptions, Path, choose_path, plan_layer
from cupymoe.tuning import Choice

H200 = DeviceFacts.h200()
SWAPAB = Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "swapab"})
# the w8a8 decode kernels the swap-AB ones stand in for, forced to decode_mma.cu's (their gate/up
# never goes by table slot, so its slot_active argument is 0 as the swap-AB launch's)
MMA = Knobs.from_env({"CUPYMOE_W8A8_DECODE": "mma"})
HOPPER_OPT_IN = 227 * 1024  # dynamic shared memory a block may opt in to
SM_SMEM = 228 * 1024  # an SM's shared memory; each resident block also takes 1 KB of the system's
FP8 = "fp8_block"


def _lp(cfg, knobs=SWAPAB, shared=FP8, arch="sm_90a", **options):
    return plan_layer(cfg, FP8, shared if cfg.has_shared_expert else None, arch,
                      options=LayerOptions(fp8_compute="w8a8", **options), knobs=knobs, table={})


def _expert_launches(plan):
    return [s for s in plan.launches if s.stage.value in ("gate_up", "down")]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
def test_off_by_default(preset):
    lp = _lp(bench.preset_config(preset), Knobs(), decode_max_tokens=256)
    assert lp.swapab_ok and not lp.swapab_chosen
    for n in (1, 16, 64, 256):
        plan = build_forward_plan(lp, H200, n, Path.DECODE).at(n)
        assert not any("swapab" in s.kernel for s in plan.launches)


@pytest.mark.parametrize("preset, n, nt", [("qwen3-30b-a3b", 16, 8), ("qwen3-30b-a3b", 64, 16),
                                           ("qwen3-30b-a3b", 256, 64), ("deepseek-v3", 16, 8),
                                           ("deepseek-v3", 256, 32), ("mixtral-8x7b", 64, 64),
                                           ("mixtral-8x7b", 256, 64)])
def test_the_knob_names_the_kernels_with_their_grids_and_args(preset, n, nt):
    """gate/up: ceil(I_max / 64) x active experts; down: ceil(H / 128) x active experts; the w8a8
    decode kernels' arguments plus the maps (down: and the shared slot); the token tile from the
    busy rows, capped at 64 (an expert past it takes passes)."""
    cfg = bench.preset_config(preset)
    lp = _lp(cfg)
    assert lp.w8a8 and lp.swapab_chosen and lp.decode_max_tokens >= C.SWAPAB_MAX_ROWS
    assert choose_path(lp, "auto", n) == "decode"
    plan = build_forward_plan(lp, H200, n, Path.DECODE).at(n)
    gate_up, down = _expert_launches(plan)
    max_active = min(lp.n_local, n * cfg.num_experts_per_tok) + lp.has_shared
    assert gate_up.kernel == f"decode_swapab_fp8_gate_up<{nt}>" and down.kernel == f"decode_swapab_fp8_down<{nt}>"
    assert gate_up.grid == (-(-lp.i_max // 64), max_active)
    assert down.grid == (-(-cfg.hidden_size // 128), max_active)
    for launch in (gate_up, down):
        assert launch.block == (C.SWAPAB_THREADS,) and launch.smem == C.swapab_fp8_smem_bytes(nt) and launch.pdl
    assert gate_up.args[-1].name == "maps" and gate_up.arg("maps") == SWAPAB_MAPS
    assert [a.name for a in down.args[-2:]] == ["maps", "shared_slot"] and down.arg("shared_slot") == lp.n_local
    reg = build_forward_plan(_lp(cfg, MMA, decode_max_tokens=256), H200, n, Path.DECODE).at(n)
    reg_gate_up, reg_down = _expert_launches(reg)
    assert reg_gate_up.kernel.startswith("decode_mma_gate_up_a8")
    assert gate_up.args[:-1] == reg_gate_up.args and down.args[:-2] == reg_down.args
    assert gate_up.arg("slot_active") == 0 and down.arg("q_out") == reg_down.arg("q_out")


def test_every_family_plans_and_names_compiled_kernels():
    """Tiny configs of every family (shared experts, biases, odd I) on decode and atomic paths:
    fp8 experts on the w8a8 swap-AB kernels; a bf16 shared expert beside them on the bf16 ones."""
    fp8_names = set(jit.MODULES["decode_swapab_fp8_sm90"].names)
    bf16_names = set(jit.MODULES["decode_swapab_sm90"].names)
    for family in testing.FAMILIES:
        cfg = testing.tiny_config(family)
        for shared in (FP8, "bf16"):
            lp = _lp(cfg, shared=shared, decode_max_tokens=256)
            mixed = cfg.has_shared_expert and shared == "bf16"
            for path, ns in ((Path.DECODE, (1, 9, 17, 64, 255)), (Path.ATOMIC, (1, 8))):
                for n in ns:
                    kernels = [s.kernel for s in _expert_launches(build_forward_plan(lp, H200, n, path).at(n))]
                    assert len(kernels) == (4 if mixed else 2), (family, shared, path, n, kernels)
                    assert set(kernels) <= fp8_names | bf16_names and set(kernels) & fp8_names, kernels
                    assert bool(set(kernels) & bf16_names) == mixed, (family, shared, kernels)


def test_w8a16_and_other_archs_keep_their_kernels():
    cfg = bench.preset_config("qwen3-30b-a3b")
    w8a16 = plan_layer(cfg, FP8, None, "sm_90a", options=LayerOptions(fp8_compute="w8a16", decode_max_tokens=64),
                       knobs=SWAPAB, table={})
    assert not w8a16.swapab_ok and not w8a16.swapab_chosen
    plan = build_forward_plan(w8a16, H200, 16, Path.DECODE).at(16)
    assert not any("swapab" in s.kernel for s in plan.launches)
    sm80 = plan_layer(cfg, FP8, None, "sm_80", options=LayerOptions(decode_max_tokens=64), knobs=SWAPAB, table={})
    assert not sm80.swapab_ok


def test_a_tuning_row_chooses_it_and_raises_the_decode_cap():
    cfg = bench.preset_config("qwen3-30b-a3b")
    key = (f"H{cfg.hidden_size} I{cfg.moe_intermediate_size} E{cfg.num_experts}/{cfg.num_experts} "
           f"k{cfg.num_experts_per_tok}", "fp8_block:w8a8")
    table = {key: ((256, Choice("decode", decode_kernel="swapab")), (512, Choice("prefill")))}
    lp = plan_layer(cfg, FP8, None, "sm_90a", knobs=Knobs(), table=table)
    assert lp.w8a8 and lp.swapab_chosen and lp.decode_max_tokens >= 256
    assert choose_path(lp, "auto", 200) == "decode" and choose_path(lp, "auto", 400) == "prefill"
    assert HX.swapab_decode(lp, 200) and not HX.swapab_decode(lp, 16)
    dk = HX.decode_kernel(lp, H200, "down", WeightFormat.FP8_BLOCK, 16.0, 128, 200)
    assert dk.name == "decode_swapab_fp8_down<32>"
    off = plan_layer(cfg, FP8, None, "sm_90a", knobs=Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "register"}),
                     table=table)
    assert not off.swapab_chosen and not HX.swapab_decode(off, 200)  # the knob overrides the table


@pytest.mark.parametrize("nt", C.SWAPAB_FP8_TOKEN_TILES)
def test_shared_memory_fits_the_opt_in_limit_and_the_blocks_an_sm(nt):
    smem = C.swapab_fp8_smem_bytes(nt)
    assert C.STATIC_SMEM_LIMIT < smem <= HOPPER_OPT_IN <= H200.max_smem
    static = 16  # gate/up's ticket flag (decode_a8.cuh), as ptxas reports it
    assert C.SWAPAB_FP8_BLOCKS_PER_SM * (smem + static + 1024) <= SM_SMEM, nt
    assert C.SWAPAB_FP8_STAGES[nt] >= 3  # the producer marks stages full STAGES - 2 steps late


def test_every_new_kernel_is_opted_in_to_what_its_launch_takes():
    """Each kernel of the module is opted in at load to its ring (past 48 KB, or every launch
    fails with "invalid argument"), the very bytes the plan launches it with."""
    names = jit.MODULES["decode_swapab_fp8_sm90"].names
    assert len(names) == 2 * len(C.SWAPAB_FP8_TOKEN_TILES)
    for name in names:
        nt = int(re.search(r"<(\d+)>", name).group(1))
        assert jit.opt_in_smem(name, H200.max_smem) == C.swapab_fp8_smem_bytes(nt) > C.STATIC_SMEM_LIMIT, name
    seen = set()
    for n in (16, 64, 200, 256):
        for preset in ("qwen3-30b-a3b", "mixtral-8x7b"):
            for s in _expert_launches(build_forward_plan(_lp(bench.preset_config(preset)), H200, n, Path.DECODE).at(n)):
                assert jit.opt_in_smem(s.kernel, H200.max_smem) == s.smem, s.kernel
                seen.add(s.kernel)
    assert seen == set(names)


def test_kernel_file_and_catalog_agree():
    """The kernel's SwapAbFp8Config and #defines against the catalog's mirror and tma.SWAPAB_MAPS."""
    from cupymoe import tma

    src = (jit.kernel_dir() / "decode_swapab_fp8_sm90.cu").read_text()
    define = lambda name: source_define(src, name)  # noqa: E731
    assert define("SF_BK") == C.SWAPAB_FP8_BK and define("SF_ROWS") == C.SWAPAB_ROWS
    assert define("SF_GATE_UP_COLUMNS") == C.SWAPAB_GATE_UP_COLUMNS
    maps = map_indices(src, "SF_")
    # the LoRA slots' maps past them are the bf16 gate/up's alone (decode_swapab_gate_up_lora)
    assert maps == {name: i for i, name in enumerate(tma.SWAPAB_MAPS) if not name.startswith("lora_")}
    stages = re.search(r"STAGES = NT <= 32 \? (\d+) : (\d+);", src).groups()
    assert all(C.SWAPAB_FP8_STAGES[nt] == int(stages[0 if nt <= 32 else 1]) for nt in C.SWAPAB_FP8_TOKEN_TILES)
    assert int(re.search(r"BLOCKS_PER_SM = (\d+);", src).group(1)) == C.SWAPAB_FP8_BLOCKS_PER_SM
    assert "SCALES = NT + 2;" in src and "THREADS = 128 + 32;" in src and C.SWAPAB_THREADS == 160
    tiles = re.search(r"static_assert\((NT == \d+(?: \|\| NT == \d+)*)", src).group(1)
    assert tuple(int(t) for t in re.findall(r"NT == (\d+)", tiles)) == C.SWAPAB_FP8_TOKEN_TILES


def test_the_maps_are_uint8_for_fp8_experts_and_bf16_for_bf16_ones(monkeypatch):
    """swapab_table encodes each projection with its format's element: fp8 routed experts as
    128-code box rows, a bf16 shared expert beside them as 64 bf16 (the driver call faked)."""
    from cupymoe import tma

    seen = []
    monkeypatch.setattr(tma, "encode", lambda m, box, what: seen.append((what, m.elem, m.box_k, box)) or bytes(128))
    cfg = testing.tiny_config("deepseek_v3")
    lp = _lp(cfg, shared="bf16")
    ptrs = {p: [0x10000 * (i + 1) for i in range(lp.n_local + 1)] for p in ("gate", "up", "down")}
    table = tma.swapab_table(lp, ptrs)
    assert len(table) == tma.MAP_BYTES * len(tma.SWAPAB_MAPS)
    assert [(e, k, b) for _, e, k, b in seen] == [(1, 128, 64)] * 3 + [(2, 64, 64)] * 3, seen
    assert tma.Matrix2D(0x10000, 64, 96, elem=1).row_bytes == 96
    tma.check_matrix(tma.Matrix2D(0x10000, 64, 96, elem=1), 64, "e4m3 codes, K = 96")
    with pytest.raises(tma.TmaError, match="of 4 bytes"):
        tma.check_matrix(tma.Matrix2D(0x10000, 64, 96, elem=4), 64, "f32")
