"""CPU tests of the swap-AB bf16 decode's dispatch (cuda/decode_swapab_sm90.cu): off by default,
on by CUPYMOE_DECODE_KERNEL=swapab or a tuning-table row, with the grids, arguments and shared
memory the kernel file expects."""

from __future__ import annotations

import re

import pytest

from _kernel_source import define as source_define, map_indices
from cupymoe import bench, catalog as C, heuristics as HX, jit, testing, tma
from cupymoe.errors import OptionError
from cupymoe.forward_plan import SWAPAB_MAPS, build_forward_plan, decode_lists_in_one_block
from cupymoe.knobs import Bf16Decode, Knobs
from cupymoe.plan import DeviceFacts, LayerOptions, Path, choose_path, plan_layer
from cupymoe.tuning import Choice

H200 = DeviceFacts.h200()
SWAPAB = Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "swapab"})
HOPPER_OPT_IN = 227 * 1024  # dynamic shared memory a block may opt in to
SM_SMEM = 228 * 1024  # an SM's shared memory; each resident block also takes 1 KB of the system's


def _lp(cfg, knobs=SWAPAB, fmt="bf16", arch="sm_90a", **options):
    shared = fmt if cfg.has_shared_expert else None
    return plan_layer(cfg, fmt, shared, arch, options=LayerOptions(**options), knobs=knobs, table={})


def _expert_launches(plan):
    return [s for s in plan.launches if s.stage.value in ("gate_up", "down")]


def test_the_knob_is_read_and_refused_by_name():
    assert Knobs().decode_kernel == Bf16Decode.AUTO and SWAPAB.decode_kernel == Bf16Decode.SWAPAB
    with pytest.raises(OptionError, match="CUPYMOE_DECODE_KERNEL='tma'"):
        Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "tma"})


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_off_by_default(preset):
    cfg = bench.preset_config(preset)
    lp = _lp(cfg, Knobs(), decode_max_tokens=256)
    assert not lp.swapab_chosen
    for n in (1, 8, 16, 64, 256):
        plan = build_forward_plan(lp, H200, n, Path.DECODE).at(n)
        assert not any("swapab" in s.kernel for s in plan.launches)


@pytest.mark.parametrize("preset, n, nt", [("qwen3-30b-a3b", 16, 8), ("qwen3-30b-a3b", 64, 16),
                                           ("qwen3-30b-a3b", 256, 64), ("mixtral-8x7b", 16, 16),
                                           ("mixtral-8x7b", 64, 64), ("mixtral-8x7b", 256, 128)])
def test_the_knob_names_the_kernels_with_their_grids_and_args(preset, n, nt):
    """gate/up: ceil(I / 64) x active experts; down: ceil(H / 128) x active experts; the decode
    kernels' arguments plus the maps (down: and the shared slot); the token tile from the busy rows."""
    cfg = bench.preset_config(preset)
    lp = _lp(cfg)
    assert lp.swapab_chosen and lp.decode_max_tokens >= C.SWAPAB_MAX_ROWS
    assert choose_path(lp, "auto", n) == "decode"  # the knob takes the decode path up to 256 rows
    plan = build_forward_plan(lp, H200, n, Path.DECODE).at(n)
    gate_up, down = _expert_launches(plan)
    max_active = min(lp.n_local, n * cfg.num_experts_per_tok)
    assert gate_up.kernel == f"decode_swapab_gate_up<{nt}>" and down.kernel == f"decode_swapab_down<{nt}>"
    assert gate_up.grid == (-(-cfg.moe_intermediate_size // 64), max_active)
    assert down.grid == (-(-cfg.hidden_size // 128), max_active)
    for launch in (gate_up, down):
        assert launch.block == (C.SWAPAB_THREADS,) and launch.smem == C.swapab_smem_bytes(nt) and launch.pdl
    assert [a.name for a in gate_up.args[-2:]] == ["maps", "slot_active"] and gate_up.arg("maps") == SWAPAB_MAPS
    assert [a.name for a in down.args[-2:]] == ["maps", "shared_slot"] and down.arg("shared_slot") == lp.n_local
    reg = build_forward_plan(_lp(cfg, Knobs(), decode_max_tokens=256), H200, n, Path.DECODE).at(n)
    reg_gate_up, reg_down = _expert_launches(reg)
    assert gate_up.args[:-2] == reg_gate_up.args and down.args[:-2] == reg_down.args


@pytest.mark.parametrize("preset, n, by_slot", [
    ("qwen3-30b-a3b", 16, False),  # ~45 of 128 experts idle: 12 blocks x 80 KB each copied for nothing
    ("qwen3-30b-a3b", 64, True), ("qwen3-30b-a3b", 128, True),
    ("qwen3-30b-a3b", 129, True), ("qwen3-30b-a3b", 256, True),  # past 1024 pairs: the one-block sort's rounds
    ("qwen3-next-80b", 128, False),  # 1280 pairs of 512 experts: the three-pass sort (no slot_active)
    ("mixtral-8x7b", 16, True),  # 8 experts, every one chosen
    ("deepseek-v3", 32, False),  # 256 experts: most idle
])
def test_gate_up_goes_by_slot_where_few_bytes_are_copied_for_nothing(preset, n, by_slot):
    """decode_swapab_gate_up's grid by table slot (first stages before the lists land,
    CUPYMOE_GATE_UP_AHEAD=auto): where one list builder made slot_active, every slot is a grid row
    and the experts nobody chose would copy at most gate_up_ahead_max_waste bytes; on:
    wherever the lists allow; off: never. The grid's shape is the same either way."""
    cfg = bench.preset_config(preset)
    slot_arg, grids = {}, set()
    for mode in ("auto", "on", "off"):
        knobs = Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "swapab", "CUPYMOE_GATE_UP_AHEAD": mode})
        lp = _lp(cfg, knobs)
        gate_up, _ = _expert_launches(build_forward_plan(lp, H200, n, Path.DECODE).at(n))
        slot_arg[mode] = gate_up.arg("slot_active")
        grids.add(gate_up.grid)
    assert len(grids) == 1
    assert (slot_arg["auto"] != 0) == by_slot
    lp = _lp(cfg, Knobs())
    allowed = decode_lists_in_one_block(lp, H200, n) and n * cfg.num_experts_per_tok >= cfg.num_experts
    assert (slot_arg["on"] != 0) == allowed and slot_arg["off"] == 0
    assert not by_slot or slot_arg["on"] == slot_arg["auto"]  # both name the lists' slot_active


def test_every_family_plans_and_names_compiled_kernels():
    """Tiny configs of every family (shared experts, biases, odd I) on decode and atomic paths."""
    names = set(jit.MODULES["decode_swapab_sm90"].names)
    for family in testing.FAMILIES:
        cfg = testing.tiny_config(family)
        lp = _lp(cfg, decode_max_tokens=256)
        for path, ns in ((Path.DECODE, (1, 9, 17, 64, 255)), (Path.ATOMIC, (1, 8))):
            for n in ns:
                kernels = [s.kernel for s in _expert_launches(build_forward_plan(lp, H200, n, path).at(n))]
                assert len(kernels) == 2 and set(kernels) <= names, (family, path, n, kernels)


def test_only_bf16_or_w8a8_on_sm90a_and_not_row_invariant():
    """fp8 as w8a8 has its own swap-AB kernels (tests/test_swapab_fp8_plans.py); w8a16 and fp4 none."""
    cfg = bench.preset_config("qwen3-30b-a3b")
    for lp in (_lp(cfg, arch="sm_80"), _lp(cfg, fmt="fp8_block", fp8_compute="w8a16"), _lp(cfg, fmt="nvfp4"),
               _lp(cfg, row_invariant=True)):
        assert not lp.swapab_ok and not lp.swapab_chosen
    assert _lp(cfg, fmt="fp8_block").swapab_ok
    lp = _lp(cfg, arch="sm_80", decode_max_tokens=64)
    plan = build_forward_plan(lp, DeviceFacts("sm_80", 108, 166912), 16, Path.DECODE).at(16)
    assert not any("swapab" in s.kernel for s in plan.launches)


def test_a_tuning_row_chooses_it_and_raises_the_decode_cap():
    cfg = bench.preset_config("qwen3-30b-a3b")
    key = (f"H{cfg.hidden_size} I{cfg.moe_intermediate_size} E{cfg.num_experts}/{cfg.num_experts} "
           f"k{cfg.num_experts_per_tok}", "bf16")
    table = {key: ((64, Choice("decode", decode_kernel="swapab")), (128, Choice("prefill", "stream")))}
    lp = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs(), table=table)
    assert lp.swapab_chosen and lp.decode_max_tokens >= 64
    assert choose_path(lp, "auto", 40) == "decode" and choose_path(lp, "auto", 100) == "prefill"
    assert HX.swapab_decode(lp, 40) and not HX.swapab_decode(lp, 8)
    off = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs.from_env({"CUPYMOE_DECODE_KERNEL": "register"}),
                     table=table)
    assert not off.swapab_chosen and not HX.swapab_decode(off, 40)  # the knob overrides the table


@pytest.mark.parametrize("nt", C.SWAPAB_TOKEN_TILES)
def test_shared_memory_fits_the_opt_in_limit_and_the_blocks_an_sm(nt):
    smem = C.swapab_smem_bytes(nt)
    assert smem <= HOPPER_OPT_IN <= H200.max_smem
    assert C.SWAPAB_BLOCKS_PER_SM[nt] * (smem + 1024) <= SM_SMEM, nt
    assert C.SWAPAB_STAGES[nt] >= 3  # the producer marks stages full STAGES - 2 steps late
    for m in ("gate_up", "down"):  # the library opts each kernel in to its ring at load (else: invalid argument)
        assert jit.opt_in_smem(f"decode_swapab_{m}<{nt}>", H200.max_smem) == smem


def test_kernel_file_and_catalog_agree():
    """The kernel's SwapAbConfig and #defines against the catalog's mirror and tma.SWAPAB_MAPS."""
    src = (jit.kernel_dir() / "decode_swapab_sm90.cu").read_text()
    define = lambda name: source_define(src, name)  # noqa: E731
    assert define("SA_BK") == C.SWAPAB_BK and define("SA_ROWS") == C.SWAPAB_ROWS
    assert define("SA_GATE_UP_COLUMNS") == C.SWAPAB_GATE_UP_COLUMNS
    maps = map_indices(src, "SA_")
    assert maps == {name: i for i, name in enumerate(tma.SWAPAB_MAPS)}
    cfg = re.search(r"STAGES = NT <= 32 \? (\d+) : NT <= 64 \? (\d+) : (\d+);", src)
    stages = dict(zip((32, 64, 128), map(int, cfg.groups())))
    assert all(C.SWAPAB_STAGES[nt] == stages[min(t for t in stages if t >= nt)] for nt in C.SWAPAB_TOKEN_TILES)
    per_sm = re.search(r"BLOCKS_PER_SM = NT <= 64 \? (\d+) : (\d+);", src).groups()
    assert all(C.SWAPAB_BLOCKS_PER_SM[nt] == int(per_sm[0 if nt <= 64 else 1]) for nt in C.SWAPAB_TOKEN_TILES)
    assert "THREADS = CWG * 128 + 32" in src and "CWG = 1;" in src and C.SWAPAB_THREADS == 160
