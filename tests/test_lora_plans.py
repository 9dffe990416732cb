"""CPU tests of the LoRA plan variant and the layer's LoRA options (no GPU needed).

A LoRA plan is the base plan with one launch more, `lora_router_delta` (prefill past the
one-block sort: `lora_grouped_router_delta`), right after the router and before the routing
stage reads the logits (each LoRA launch by PDL exactly where the
launch after it goes by PDL: inside the decode chain); with the experts' deltas (a layer whose
slots take them; a w8a8 layer's LoRA plans then come from plan.lora_options, as w8a16), each
gate/up GEMM runs once storing g and u side by side (ACT_PAIR, into
lora_gu), then lora_gate_up_act, and lora_down_delta before the reduce; everything else is the
base plan's.
"""

from __future__ import annotations

import pytest

from cupymoe import catalog as C
from cupymoe import jit, testing
from cupymoe.bench import preset_config
from cupymoe.catalog import LORA_RED, Activation, LoraDownMode
from cupymoe.errors import LoraError, OptionError
from cupymoe.forward_plan import (LORA_GROUPED_SMEM_MAX, LORA_MMA_WARPS, LORA_ROUTER_ROWS, LORA_ROUTER_WAVE, LORA_SUB,
                                  LoraShape, build_forward_plan, lora_chunk_blocks, lora_down_slices,
                                  lora_grouped, lora_grouped_smem, lora_router_span, lora_slices)
from cupymoe.knobs import Knobs
from cupymoe.lora_slots import check_options
from cupymoe.plan import Buf, CallValue, DeviceFacts, LayerOptions, Path, Space, Stage, plan_layer
from cupymoe.workspace import layer_need

H200 = DeviceFacts.h200()
A100 = DeviceFacts("sm_80", 108, 166912)
SHAPE = LoraShape(max_loras=3, max_rank=16, fold=False)  # the deltas as launches of their own (the fold: below)


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_lora_plan_is_the_base_plan_plus_the_router_delta(family, dev):
    cfg = testing.tiny_config(family)
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, dev.arch,
                    options=LayerOptions(decode_max_tokens=64), knobs=Knobs())
    names = {n for m in jit.modules_for(dev.arch) for n in jit.MODULES[m].names}
    for path, n in ((Path.DECODE, 1), (Path.DECODE, 17), (Path.ATOMIC, 5), (Path.PREFILL, 300), (Path.PREFILL, 5000)):
        base = build_forward_plan(lp, dev, n, path).at(n)
        plan = build_forward_plan(lp, dev, n, path, lora=SHAPE).at(n)
        assert len(plan.steps) == len(base.steps) + 1
        grouped = lora_grouped(build_forward_plan(lp, dev, n, path), lp, SHAPE)
        kernel = "lora_grouped_router_delta" if grouped else "lora_router_delta"
        at = [i for i, s in enumerate(plan.steps) if getattr(s, "kernel", "").endswith("router_delta")]
        assert len(at) == 1 and plan.steps[at[0] - 1].stage == Stage.ROUTER
        assert plan.steps[at[0] + 1].stage != Stage.ROUTER  # the routing stage reads the logits after it
        assert plan.steps[:at[0]] + plan.steps[at[0] + 1:] == base.steps
        d = plan.steps[at[0]]
        assert d.kernel == kernel and d.kernel in names
        if grouped:  # lora_chunk_blocks blocks lora_router_span rows, 8 warps
            Y = lora_chunk_blocks(SHAPE.max_loras)
            assert d.grid == (-(-n // lora_router_span(n, Y)), Y) and d.arg("span") == lora_router_span(n, Y)
            assert d.block == (LORA_MMA_WARPS * 32,)
            assert d.smem == lora_grouped_smem(SHAPE.max_rank, False)
        else:
            assert d.grid == (n, lora_slices(n, cfg.hidden_size)) and d.smem == (SHAPE.max_rank + LORA_RED) * 4
            assert d.arg("part") == Buf(Space.SCRATCH, "lora_part")
            assert d.arg("tickets") == Buf(Space.SCRATCH, "lora_tickets")
        assert plan.steps[at[0] + 1].pdl == (path == Path.DECODE and dev is H200)
        # as its successor, but by PDL after the router on the prefill path (lora_overlap)
        assert d.pdl == (path in (Path.DECODE, Path.PREFILL) and dev is H200)
        assert d.arg("lora_ids") == CallValue.LORA_IDS and d.arg("logits") == Buf(Space.SCRATCH, "logits")
        assert (d.arg("R"), d.arg("max_rank"), d.arg("max_loras"), d.arg("N")) == (cfg.router_width, 16, 3, n)


@pytest.mark.parametrize("k, r, match", [(-1, 0, "max_loras=-1"), (2, 0, "give both"), (0, 4, "give both"),
                                         (True, 4, "max_loras=True"), (2, 1.5, "max_lora_rank=1.5")])
def test_lora_options_refused(k, r, match):
    with pytest.raises(OptionError, match=match):
        check_options(k, r)
    assert check_options(0, 0) == (0, 0) and check_options(4, 16) == (4, 16)


EXPERTS = LoraShape(max_loras=3, max_rank=16, experts=True, fold=False)


def _gate_up_gemms(plan):
    return [s for s in plan.steps if getattr(s, "stage", None) == Stage.GATE_UP and
            any(a.name == "act_code" for a in getattr(s, "args", ())) and not s.kernel.startswith("lora_")]


DELTAS = {False: ("lora_gate_up_act", "lora_down_delta"), True: ("lora_grouped_gate_up_act", "lora_grouped_down_delta")}


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family, fmt", [(f, "bf16") for f in testing.FAMILIES] +
                         [("qwen3_moe", "nvfp4"), ("gpt_oss", "mxfp4"), ("qwen2_moe", "fp8_block")])
def test_expert_lora_plan(family, fmt, dev):
    """The experts' LoRA plan: each gate/up GEMM once, with ACT_PAIR (g and u into lora_gu),
    lora_gate_up_act after the last (lora_gu in, act out), lora_down_delta right before the
    reduce, every other launch the router-LoRA plan's own, in order."""
    cfg = testing.tiny_config(family)
    lp = plan_layer(cfg, fmt, "bf16" if cfg.has_shared_expert else None, dev.arch,
                    options=LayerOptions(decode_max_tokens=64, fp8_compute="w8a16"), knobs=Knobs())
    names = {n for m in jit.modules_for(dev.arch) for n in jit.MODULES[m].names}
    sh = 1 if cfg.has_shared_expert else 0
    mode = {Path.DECODE: LoraDownMode.DECODE, Path.ATOMIC: LoraDownMode.ATOMIC, Path.PREFILL: LoraDownMode.GROUPED}
    for path, n in ((Path.DECODE, 1), (Path.DECODE, 37), (Path.ATOMIC, 5), (Path.PREFILL, 300), (Path.PREFILL, 5000)):
        router_only = build_forward_plan(lp, dev, n, path, lora=SHAPE).at(n)
        plan = build_forward_plan(lp, dev, n, path, lora=EXPERTS).at(n)
        base_gemms, gemms = _gate_up_gemms(router_only), _gate_up_gemms(plan)
        assert len(gemms) == len(base_gemms) >= 1
        for b, g in zip(base_gemms, gemms):
            out = "act" if b.kernel.startswith("decode") else "out"
            assert g.arg("act_code") == Activation.PAIR and b.arg("act_code") != Activation.PAIR
            assert b.arg(out) == Buf(Space.SCRATCH, "act") and g.arg(out) == Buf(Space.SCRATCH, "lora_gu")
            assert [a for a in g.args if a.name not in ("act_code", out)] == \
                [a for a in b.args if a.name not in ("act_code", out)]
            assert (g.kernel, g.grid, g.pdl, g.smem) == (b.kernel, b.grid, b.pdl, b.smem)
        kinds = [getattr(s, "kernel", None) for s in plan.steps]
        grouped = lora_grouped(plan, lp, EXPERTS)
        ga, dd = (kinds.index(name) for name in DELTAS[grouped])
        assert plan.steps[ga - 1].stage == Stage.GATE_UP and plan.steps[ga + 1].stage != Stage.GATE_UP
        assert plan.steps[dd - 1].stage == Stage.DOWN and plan.steps[dd + 1].stage == Stage.REDUCE
        for i in (ga, dd):
            s = plan.steps[i]
            assert s.kernel in names and s.arg("max_rank") == 16
            assert s.pdl == plan.steps[i + 1].pdl == (path == Path.DECODE and dev is H200)  # as its successor
            assert s.arg("lora_ids") == CallValue.LORA_IDS
        if grouped:
            _check_grouped(plan, ga, dd, gemms, cfg.hidden_size)
        else:
            pairs = n * (cfg.num_experts_per_tok + sh)
            for i, cols in ((ga, cfg.hidden_size), (dd, lp.i_max)):
                assert plan.steps[i].grid == (pairs, lora_slices(pairs, cols)) and plan.steps[i].arg("N") == n
                assert plan.steps[i].arg("part") == Buf(Space.SCRATCH, "lora_part")
            assert plan.steps[dd].arg("mode") == mode[path] and plan.steps[ga].smem == (2 * 16 + LORA_RED) * 4
        assert plan.steps[ga].arg("gu") == Buf(Space.SCRATCH, "lora_gu")
        assert plan.steps[ga].arg("act") == plan.steps[dd].arg("act") == Buf(Space.SCRATCH, "act")
        others = [s for s in plan.steps if s not in gemms and getattr(s, "kernel", "") not in DELTAS[grouped]]
        assert others == [s for s in router_only.steps if s not in base_gemms]


def _check_grouped(plan, ga, dd, gemms, hidden):
    """The grouped deltas: lora_chunk_blocks blocks a tile of the GEMM right before (its tile list,
    its grid's tile bound), down's also over lora_down_slices column slices of H, 8 warps, the
    warps' partial t and the summed t in shared memory; down adds into yw."""
    down_gemm = plan.steps[dd - 1]
    y = lora_chunk_blocks(EXPERTS.max_loras)
    for delta, gemm, z in ((plan.steps[ga], gemms[-1], ()), (plan.steps[dd], down_gemm, (lora_down_slices(hidden),))):
        assert delta.grid == (gemm.grid[1], y, *z) and delta.block == (LORA_MMA_WARPS * 32,)
        assert (delta.arg("num_tiles"), delta.arg("tile_info")) == (gemm.arg("num_tiles"), gemm.arg("tile_info"))
    assert plan.steps[ga].smem == lora_grouped_smem(16, True) == 9 * 2 * 32 * 16 * 4
    assert plan.steps[dd].smem == lora_grouped_smem(16, False) == 9 * 32 * 16 * 4
    assert plan.steps[dd].arg("yw") == Buf(Space.SCRATCH, "yw")


def test_expert_lora_plan_refuses_w8a8():  # a w8a8 LayerPlan; the layer builds its LoRA plans from lora_options
    cfg = testing.tiny_config("deepseek_v3")
    lp = plan_layer(cfg, "fp8_block", "bf16" if cfg.has_shared_expert else None, "sm_90a",
                    options=LayerOptions(fp8_compute="w8a8"), knobs=Knobs())
    assert lp.w8a8
    with pytest.raises(LoraError, match="LoRA on the experts with fp8_compute='w8a8' is not implemented"):
        build_forward_plan(lp, H200, 4, Path.DECODE, lora=EXPERTS)
    build_forward_plan(lp, H200, 4, Path.DECODE, lora=SHAPE)  # router-only adapters still run


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_w8a8_layer_lora_plans_as_w8a16_on_one_scratch(family):
    """MoeLayer(fp8_compute="w8a8", lora_experts=True): the LoRA plans come from plan.lora_options's LayerPlan
    (w8a16: no w8a8 kernel, the experts' deltas in), the base plans keep w8a8, and layer_need(lora_lp=)'s
    one scratch holds every buffer both name (the decode rows of both plans, gathered inputs of either)."""
    from dataclasses import replace

    from cupymoe.forward_plan import lora_router_t_rows, lora_stack_parts
    from cupymoe.lora_stack import stack_width
    from cupymoe.plan import lora_options

    cfg = testing.tiny_config(family)
    options = LayerOptions(fp8_compute="w8a8")
    shared = "bf16" if cfg.has_shared_expert else None
    base = plan_layer(cfg, "fp8_block", shared, "sm_90a", options=options, knobs=Knobs())
    lora_lp = plan_layer(cfg, "fp8_block", shared, "sm_90a", options=lora_options(options), knobs=Knobs())
    assert base.w8a8 and not lora_lp.w8a8 and lora_lp.fp8_compute.value == "w8a16"
    K, R = 3, 16
    parts = lora_stack_parts(lora_lp, 1, K, R)
    lora_lp = replace(lora_lp, lora_router_t_rows=lora_router_t_rows(lora_lp, None, K, R))
    ks = stack_width(K, R, parts) if parts else 0
    T = 1200
    scratch, _ = layer_need(base, T, lora_experts=True, lora_rank=R, lora_stack_ks=ks,
                            lora_router_t_cols=C.lora_router_t_cols(K, R) if lora_lp.lora_router_t_rows else 0,
                            lora_lp=lora_lp)
    shape = LoraShape(max_loras=K, max_rank=R, experts=True, stack_parts=parts)
    for path, n in ((Path.DECODE, 1), (Path.DECODE, 7), (Path.ATOMIC, 5), (Path.PREFILL, 300), (Path.PREFILL, T)):
        for lp, lora in ((base, None), (lora_lp, shape)):
            plan = build_forward_plan(lp, H200, n, path, lora=lora).at(n)
            kernels = [getattr(st, "kernel", "") for st in plan.steps]
            if lora is not None:
                assert not any("_a8" in k or "sm90_fp8" in k for k in kernels), kernels
                assert any(k.startswith(("lora_", "grouped_gemm_lora")) and "router" not in k for k in kernels)
            for st in plan.steps:
                for a in getattr(st, "args", ()):
                    b = getattr(a, "value", None)
                    zeroed = ("act_tickets", "lora_tickets")  # the zeroed region's, not the scratch plan's
                    if isinstance(b, Buf) and b.space == Space.SCRATCH and b.name not in zeroed:
                        assert b.name in scratch.placements and scratch.placements[b.name].nbytes > 0, (path, n, b)


def test_lora_gu_scratch_only_with_expert_lora():
    """lora_gu holds a position's g and u (2 i_max bf16) for every routed and shared position,
    after every base buffer, so the base placements stay where they were."""
    cfg = testing.tiny_config("qwen2_moe")
    lp = plan_layer(cfg, "bf16", "bf16", "sm_90a", knobs=Knobs())
    base, _ = layer_need(lp, 300)
    with_gu, _ = layer_need(lp, 300, lora_experts=True)
    assert "lora_gu" not in base.placements and "lora_u" not in with_gu.placements
    assert {k: v for k, v in with_gu.placements.items() if k != "lora_gu"} == base.placements
    assert with_gu.placements["lora_gu"].nbytes == 300 * (cfg.num_experts_per_tok + 1) * 2 * lp.i_max * 2


def test_grouped_deltas_by_path_rows_and_rank():
    """Prefill plans past the one-block sort take the grouped deltas, fewer rows and decode /
    atomic the per-pair ones; a row-invariant layer's prefill plans take them at every N (a
    row's kernels never change with N); a rank whose warps' shared memory passes the default cap
    falls back to the per-pair kernels."""
    cfg = testing.tiny_config("qwen3_moe")
    for invariant in (False, True):
        lp = plan_layer(cfg, "bf16", None, "sm_90a", knobs=Knobs(),
                        options=LayerOptions(row_invariant=invariant, decode_max_tokens=None if invariant else 64))
        paths = ((Path.PREFILL, 1), (Path.PREFILL, 67), (Path.PREFILL, 1100))
        if not invariant:
            paths += ((Path.DECODE, 5), (Path.ATOMIC, 5))
        for path, n in paths:
            for rank, fits in ((1, True), (16, True), (32, True), (33, False), (64, False)):
                shape = LoraShape(max_loras=4, max_rank=rank, experts=True)
                plan = build_forward_plan(lp, H200, n, path, lora=shape)
                many = plan.shape is not None and not plan.shape.one_block_sort
                want = fits and path == Path.PREFILL and (invariant or many)
                assert lora_grouped(plan, lp, shape) == want
                kinds = {getattr(s, "kernel", None) for s in plan.at(n).steps}
                assert set(DELTAS[want]) <= kinds and not set(DELTAS[not want]) & kinds, (path, n, rank)
    assert not build_forward_plan(lp, H200, 1100, Path.PREFILL).shape.one_block_sort  # both kinds were seen


@pytest.mark.parametrize("dev", [H200, A100, DeviceFacts("sm_86", 84, 101376)], ids=["sm_90a", "sm_80", "sm_86"])
def test_grouped_deltas_shared_memory_is_opted_in(dev):
    """The grouped deltas' shared memory (past 48 KB from rank 32) is within what the library opts
    each of them in to at load, beside their static buckets, on every arch."""
    assert lora_grouped_smem(16, True) == 9 * 2 * 32 * 16 * 4 and lora_grouped_smem(32, True) > 48 * 1024
    assert lora_grouped_smem(32, True) <= LORA_GROUPED_SMEM_MAX < lora_grouped_smem(33, True)
    for name in (n for n in jit.MODULES["lora"].names if n.startswith("lora_grouped_")):
        assert jit.opt_in_smem(name, dev.max_smem) >= LORA_GROUPED_SMEM_MAX, name
        assert jit.opt_in_smem(name, dev.max_smem) + 4096 <= dev.max_smem


def test_grouped_split_counts():
    """lora_chunk_blocks: 4 blocks a tile up to 4 adapters, 8 past; lora_down_slices: slices of
    LORA_DOWN_SLICE columns at least, at most LORA_DOWN_SLICES_MAX."""
    assert [lora_chunk_blocks(k) for k in (1, 4, 5, 16)] == [4, 4, 8, 8]
    assert [lora_down_slices(h) for h in (64, 776, 1024, 2048, 4096, 7168)] == [1, 1, 2, 4, 4, 4]


# Every gate/up family a LoRA plan launches with ACT_PAIR must store g and u side by side into
# lora_gu (common.cuh store_gate_up, or with_activation<true> in the GEMM epilogues); a kernel
# that ran apply_activation(ACT_PAIR, ..) would store silu(g) u at act's stride instead, and
# lora_gate_up_act would read garbage as g and u.
_PAIR_STORES = ("store_gate_up(", "store_gate_up_act<", "emit_wgmma_rows<", "with_activation<true>")


def _kernel_body(src: str, name: str) -> str:
    """The text of __global__ kernel `name` in `src`, up to the next __global__ (its own body)."""
    at = src.index(f"\n{name}(")
    end = src.find("__global__", at)
    return src[at:end if end > 0 else len(src)]


@pytest.mark.parametrize("path", [Path.DECODE, Path.ATOMIC])
def test_swapab_gate_up_stores_act_pair(path):
    """The bf16 swap-AB decode (chosen by CUPYMOE_DECODE_KERNEL=swapab or a by_shape row, N = 16-128
    on the measured shapes) serves LoRA plans too: its gate/up gets ACT_PAIR and lora_gu as
    `act`, so its epilogue must store through store_gate_up (review: it called apply_activation
    with code 4, silu(g) u at stride I_max, so every LoRA forward on those cells was wrong)."""
    import dataclasses
    from pathlib import Path as FsPath

    from cupymoe.knobs import Bf16Decode
    cfg = testing.tiny_config("qwen3_moe")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(decode_max_tokens=64),
                    knobs=dataclasses.replace(Knobs(), decode_kernel=Bf16Decode.SWAPAB))
    plan = build_forward_plan(lp, H200, 32, path, lora=EXPERTS).at(32)
    gemms = _gate_up_gemms(plan)
    assert gemms and all(g.kernel.startswith(("decode_swapab_gate_up<", "decode_swapab_gate_up_lora<")) for g in gemms)
    for g in gemms:
        assert g.arg("act_code") == int(Activation.PAIR) and g.arg("act") == Buf(Space.SCRATCH, "lora_gu")
    src = (FsPath(jit.__file__).resolve().parent.parent / "cuda" / "decode_swapab_sm90.cu").read_text()
    assert "sa_gate_up_columns<NT>(" in _kernel_body(src, "decode_swapab_gate_up")  # its blocks' body
    at = src.index("void sa_gate_up_columns(")
    body = src[at:src.index("__global__", at)]
    assert any(s in body for s in _PAIR_STORES), "decode_swapab_gate_up ignores ACT_PAIR"
    assert "apply_activation(" not in body


@pytest.mark.parametrize("max_loras, max_rank, blocks", [(3, 16, 1), (4, 16, 1), (3, 32, 2), (9, 8, 2), (3, 12, 0)])
def test_swapab_lora_form(max_loras, max_rank, blocks):
    """CUPYMOE_LORA_SWAPAB: where the decode's one gate/up is the bf16 swap-AB kernel, it becomes
    decode_swapab_gate_up_lora with ceil(K R / 64) more blocks an expert past its column blocks
    (lora_x0), storing s t into lora_pair_t, and lora_gate_up_expand_act replaces lora_gate_up_act;
    a rank the form has no tiles for (12) keeps the per-pair kernels; so do the knob off, the
    register decode and the prefill path."""
    import dataclasses

    from cupymoe import heuristics as HX
    from cupymoe.knobs import Bf16Decode, LoraSwapab
    cfg = testing.tiny_config("qwen2_moe")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(decode_max_tokens=64),
                    knobs=dataclasses.replace(Knobs(), decode_kernel=Bf16Decode.SWAPAB))
    shape = dataclasses.replace(EXPERTS, max_loras=max_loras, max_rank=max_rank, swapab=LoraSwapab.ON)
    plan = build_forward_plan(lp, H200, 32, Path.DECODE, lora=shape).at(32)
    kinds = [getattr(st, "kernel", "") for st in plan.steps]
    if not blocks:
        assert "lora_gate_up_act" in kinds and "lora_gate_up_expand_act" not in kinds, kinds
        return
    off = dataclasses.replace(shape, swapab=LoraSwapab.OFF)
    base = build_forward_plan(lp, H200, 32, Path.DECODE, lora=off).at(32)
    (gemm,), (was,) = _gate_up_gemms(plan), _gate_up_gemms(base)
    assert gemm.kernel == was.kernel.replace("decode_swapab_gate_up<", "decode_swapab_gate_up_lora<")
    assert gemm.grid == (was.grid[0] + blocks,) + tuple(was.grid[1:]) and gemm.arg("lora_x0") == was.grid[0]
    assert gemm.arg("lora_t") == Buf(Space.SCRATCH, "lora_pair_t") and gemm.arg("act_code") == int(Activation.PAIR)
    assert jit.opt_in_smem(gemm.kernel, H200.max_smem) == gemm.smem > 48 * 1024  # its ring, opted in at load
    assert "lora_gate_up_expand_act" in kinds and "lora_gate_up_act" not in kinds, kinds
    expand = next(st for st in plan.steps if getattr(st, "kernel", "") == "lora_gate_up_expand_act")
    assert expand.grid == (32 * (cfg.num_experts_per_tok + 1),) and expand.pdl == gemm.pdl
    kinds = [getattr(st, "kernel", "") for st in build_forward_plan(lp, H200, 32, Path.DECODE, lora=off).at(32).steps]
    assert "lora_gate_up_act" in kinds, kinds
    auto = dataclasses.replace(shape, swapab=LoraSwapab.AUTO)  # from LORA_SWAPAB_PAIRS_A_SLOT pairs an (expert, slot)
    for n in (8, 16, 32, 64):
        kinds = [getattr(st, "kernel", "") for st in build_forward_plan(lp, H200, n, Path.DECODE, lora=auto).at(n).steps]
        want = n * cfg.num_experts_per_tok >= HX.LORA_SWAPAB_PAIRS_A_SLOT * cfg.num_experts * max_loras
        assert ("lora_gate_up_expand_act" in kinds) == want == HX.lora_swapab_rows(lp, n, max_loras), (n, kinds)
    reg = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(decode_max_tokens=64),
                     knobs=dataclasses.replace(Knobs(), decode_kernel=Bf16Decode.REGISTER))
    kinds = [getattr(st, "kernel", "") for st in build_forward_plan(reg, H200, 32, Path.DECODE, lora=shape).at(32).steps]
    assert "lora_gate_up_act" in kinds, kinds


def test_row_invariant_per_pair_deltas_do_not_split_with_n():
    """A row-invariant layer past the grouped kernels' ranks (shared memory over
    LORA_GROUPED_SMEM_MAX) runs the per-pair LoRA kernels at every prefill N; their slice count
    sets the shrink's summation order (lora_slice, then the slices added in order), so it must
    not change with N (review: 16 slices at N = 1, 11 at N = 100, 1 at N = 2000 for H = 2048,
    rank 64; a row's bits then depended on the other rows). lora_down_delta split by its output
    columns (by_cols) does each pair's whole shrink in every block: any count keeps the bits."""
    import dataclasses
    cfg = dataclasses.replace(testing.tiny_config("qwen3_moe"), hidden_size=2048)
    rank = 64
    assert lora_grouped_smem(rank, True) > LORA_GROUPED_SMEM_MAX
    shape = LoraShape(max_loras=3, max_rank=rank, experts=True)
    for ri in (True, False):
        lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(row_invariant=ri), knobs=Knobs())
        grids = {}
        for n in (1, 3, 100, 2000):
            plan = build_forward_plan(lp, H200, n, Path.PREFILL, lora=shape).at(n)
            for s in plan.steps:
                if getattr(s, "kernel", "") in ("lora_router_delta", "lora_gate_up_act", "lora_down_delta"):
                    by_cols = any(a.name == "by_cols" and a.value for a in s.args)
                    grids.setdefault(s.kernel, set()).add(1 if by_cols else s.grid[1])
        assert set(grids) == {"lora_router_delta", "lora_gate_up_act", "lora_down_delta"}
        if ri:
            assert all(ys == {1} for ys in grids.values()), grids
        else:  # elsewhere the split stays (bits may differ by N off row_invariant)
            assert max(grids["lora_router_delta"]) > 1


def test_router_span_keeps_one_wave_while_it_can():
    """lora_router_span: 32 rows up to one wave of blocks, then the least multiple of 16 that keeps
    ceil(N / span) Y blocks within LORA_ROUTER_WAVE, LORA_SUB at most; cuda/lora.cu's bucket holds it."""
    src = (jit.kernel_dir() / "lora.cu").read_text()
    assert f"#define LORA_SUB {LORA_SUB} " in src
    for Y in (4, 8):
        for n in list(range(1, 40)) + [1024, 3168, 3169, 4096, 5000, 8192, 16384, 50000, 10 ** 6]:
            s = lora_router_span(n, Y)
            assert LORA_ROUTER_ROWS <= s <= LORA_SUB and s % 16 == 0
            fits = lambda r: -(-n // r) * Y <= LORA_ROUTER_WAVE  # noqa: E731
            if s == LORA_ROUTER_ROWS:
                continue
            assert s == LORA_SUB or (fits(s) and not fits(s - 16)), (n, Y, s)
    assert lora_router_span(1024, 4) == 32 and lora_router_span(4096, 4) == 64 and lora_router_span(4096, 8) == 128


def test_early_start_rests_on_release_after_wait():
    """The per-pair kernels' early start (cuda/lora.cu: shrink, ticket and held expand before the
    PDL wait) reads what the kernels before its predecessor wrote, so every kernel must release
    its successor only after its own wait: griddepcontrol.launch_dependents appears in cuda/ after
    the wait in pdl_wait_then_release_next, and in pdl_release_early, which lora_gate_up_act alone
    calls at its top (its successor, down, reads before its wait what was complete before
    lora_gate_up_act launched). Each per-pair kernel waits at one site, and any
    return before it spares block 0 (the grid never completes before the kernel it follows)."""
    from pathlib import Path as P

    src = {f.name: f.read_text() for f in (P(jit.kernel_dir())).glob("*.cu*")}
    assert [n for n, s in src.items() if "launch_dependents" in s] == ["common.cuh"]
    common = src["common.cuh"]
    assert common.count("launch_dependents") == 2  # pdl_wait_then_release_next and pdl_release_early
    # the early release (before the wait) serves lora_gate_up_act alone: down reads before its own
    # wait only the lists, complete before gate/up's wait released lora_gate_up_act
    assert {n: s.count("pdl_release_early()") for n, s in src.items() if "pdl_release_early()" in s} == \
        {"common.cuh": 1, "lora.cu": 1}
    act = src["lora.cu"][src["lora.cu"].index("\nlora_gate_up_act("):]
    assert act.index("pdl_release_early()") < act.index("pdl_wait_then_release_next()") < act.index("\n}\n")
    body = common[common.index("void pdl_wait_then_release_next()"):]
    assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")
    lora = src["lora.cu"]
    for kernel in ("lora_router_delta", "lora_gate_up_act", "lora_down_delta"):
        k = lora[lora.index(f"\n{kernel}("):]
        k = k[:k.index("\n}\n")]
        assert k.count("pdl_wait_then_release_next()") == 1 and "pdl_leave_early" not in k, kernel
        before = k[:k.index("pdl_wait_then_release_next()")]
        assert all("!lora_block0()" in line for line in before.splitlines() if "return" in line), kernel
    from cupymoe.forward_plan import LORA_FOLD_SLICES

    assert f"#define LORA_FOLD_SLICES {LORA_FOLD_SLICES}\n" in src["lora_common.cuh"]
    decode = src["decode.cu"]  # the folded delta: every block waits, at one site, nothing returns before it
    for kernel in ("decode_route_lists_lora",):
        k = decode[decode.index(f"\n{kernel}("):]
        k = k[:k.index("\n}\n")]
        assert k.count("pdl_wait_then_release_next()") == 1, kernel
        before = k[:k.index("pdl_wait_then_release_next()")].splitlines()
        assert not [line for line in before if "return" in line and "[&]" not in line], kernel  # lambdas' own


@pytest.mark.parametrize("dev", [H200, A100], ids=["sm_90a", "sm_80"])
@pytest.mark.parametrize("family", testing.FAMILIES)
def test_decode_fold(family, dev):
    """At the decode path's fewest rows (heuristics.LORA_FOLD_ROWS) the router's delta folds into
    the router and routing launches: router_logits_bf16_lora (the router's grid, then
    lora_fold_slices blocks, each a slice of the shrink and its share of the expand; its arguments,
    then the ids, the slots' A and scale * B, lora_part, the error word, the sizes) and
    decode_route_lists_lora (its arguments, then the ids, lora_part, the shares' count, the slots');
    lora_router_delta is gone and every other launch is the unfolded plan's. Past those rows, with
    the knob off, or on another path, the plan is unfolded."""
    from cupymoe import heuristics as HX
    from cupymoe.forward_plan import LORA_FOLD_SLICES, lora_fold_slices

    cfg = testing.tiny_config(family)
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, dev.arch,
                    options=LayerOptions(decode_max_tokens=64, fp8_compute="w8a16"), knobs=Knobs())
    names = {n for m in jit.modules_for(dev.arch) for n in jit.MODULES[m].names}
    n, H = HX.LORA_FOLD_ROWS, cfg.hidden_size
    for experts in (False, True):
        fold = LoraShape(max_loras=3, max_rank=16, experts=experts)
        apart = LoraShape(max_loras=3, max_rank=16, experts=experts, fold=False)
        folded = build_forward_plan(lp, dev, n, Path.DECODE, lora=fold).at(n)
        unfolded = build_forward_plan(lp, dev, n, Path.DECODE, lora=apart).at(n)
        kinds = [getattr(s, "kernel", "") for s in folded.steps]
        assert "lora_router_delta" not in kinds and kinds[1] == "decode_route_lists_lora", kinds
        router, route = folded.steps[:2]
        base_router, delta, base_route = unfolded.steps[:3]
        assert delta.kernel == "lora_router_delta" and base_route.kernel == "decode_route_lists"
        assert router.kernel == base_router.kernel.replace("router_logits_bf16<", "router_logits_bf16_lora<")
        assert router.kernel in names and route.kernel in names
        slices = lora_fold_slices(n, lp)
        assert slices == min(lora_slices(n, H), LORA_FOLD_SLICES) and delta.grid == (n, lora_slices(n, H))
        assert router.grid == (base_router.grid[0] + slices,) + base_router.grid[1:]
        assert router.args[:len(base_router.args)] == base_router.args and router.smem == 16 * 4
        assert [a.name for a in router.args[len(base_router.args):]] == ["lora_ids", "lora_a", "lora_bs", "part",
                                                                          "err", "max_rank", "max_loras"]
        assert route.args[:len(base_route.args)] == base_route.args
        assert [a.name for a in route.args[len(base_route.args):]] == ["lora_ids", "part", "S", "max_loras"]
        assert router.arg("part") == route.arg("part") == delta.arg("part") and route.arg("S") == slices
        assert router.arg("lora_a") == delta.arg("a") and router.arg("lora_bs") == delta.arg("bs")
        assert route.smem == C.route_lists_lora_smem_bytes(n, cfg.num_experts_per_tok, cfg.router_width)
        assert (router.pdl, route.pdl) == (base_router.pdl, base_route.pdl)
        assert folded.steps[2:] == unfolded.steps[3:]
        for path, m, shape in ((Path.DECODE, n + 1, fold), (Path.ATOMIC, n, fold), (Path.DECODE, n, apart)):
            kinds = [getattr(s, "kernel", "") for s in build_forward_plan(lp, dev, m, path, lora=shape).at(m).steps]
            assert not any(k.endswith("_lora") or "_lora<" in k for k in kinds[:2]), (path, m, kinds)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("n", [300, 1100, 4096])
def test_prefill_overlap_only_where_pdl_runs(preset, n):
    """lora_overlap: the prefill router delta and the stacked GEMMs go by PDL on sm_90 with PDL on,
    never with CUPYMOE_LORA_OVERLAP=0, with CUPYMOE_PDL=0, in a separated plan (stage events stand
    between the launches) or on sm_80; every other launch keeps its flag (prefill: plain)."""
    def plan(dev=H200, knobs=Knobs(math_rows=1), **kw):
        cfg = preset_config(preset)
        lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, dev.arch, knobs=knobs, table={})
        sep = kw.pop("separated", False)
        shape = LoraShape(4, 16, True, 1, **kw)  # the stacked form, one part
        return build_forward_plan(lp, dev, n, Path.PREFILL, lora=shape, separated=sep).at(n)

    def pdl_kernels(p):
        return sorted(s.kernel for s in p.steps if getattr(s, "pdl", False))

    on = pdl_kernels(plan())
    assert [k for k in on if "router_delta" in k] == ["lora_grouped_router_delta"]
    assert len([k for k in on if k.startswith("grouped_gemm_sm90_tma_lora<")]) == 2 and len(on) == 3
    assert pdl_kernels(plan(overlap=False)) == pdl_kernels(plan(separated=True)) == []
    assert pdl_kernels(plan(knobs=Knobs(math_rows=1, pdl=False))) == []
    assert pdl_kernels(plan(dev=A100)) == []


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_prefill_router_t(family):
    """Up to lp.lora_router_t_rows prefill rows the router GEMM takes the slots' A rows in three
    parts as ceil(3 K R / 128) more column tiles (grouped_gemm_lora<2, ...>: t into lora_router_t) and
    top-k adds the delta (topk_route_lora, its warps' t past topk_route's scratch); past them, with
    the rows at 0 (the knob), or where the router is the wgmma GEMM, lora_grouped_router_delta. The
    base launches are otherwise the plan's; every kernel is built; the scratch holds t's K split copies
    for the rows the form serves."""
    from dataclasses import replace

    from cupymoe.forward_plan import lora_router_t_rows

    cfg = testing.tiny_config(family)
    base_lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, "sm_90a", knobs=Knobs())
    shape = LoraShape(max_loras=4, max_rank=16, experts=True)
    cols = C.lora_router_t_cols(4, 16)
    assert cols == 192 and lora_router_t_rows(base_lp, None, 4, 16) == 1024
    assert lora_router_t_rows(base_lp, 300, 4, 16) == 300 and lora_router_t_rows(base_lp, None, 4, 43) == 0
    invariant = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, "sm_90a", knobs=Knobs(),
                           options=LayerOptions(row_invariant=True))
    assert lora_router_t_rows(invariant, 4096, 4, 16) == 0  # one form at every N
    lp = replace(base_lp, lora_router_t_rows=lora_router_t_rows(base_lp, None, 4, 16))
    names = {n for m in jit.modules_for("sm_90a") for n in jit.MODULES[m].names}
    for n, fused in ((300, True), (1024, True), (1025, False)):
        base = build_forward_plan(lp, H200, n, Path.PREFILL).at(n)
        plan = build_forward_plan(lp, H200, n, Path.PREFILL, lora=shape).at(n)
        router, route = plan.steps[0], plan.steps[1]
        if not fused:
            assert route.kernel == "lora_grouped_router_delta"
            continue
        b_router, b_route = base.steps[0], base.steps[1]
        assert router.kernel == "grouped_gemm_lora<" + b_router.kernel[len("grouped_gemm<"):] and router.kernel in names
        assert router.grid == (b_router.grid[0] + 2,) + b_router.grid[1:]
        assert router.args[:len(b_router.args)] == b_router.args
        assert router.arg("lora_t") == Buf(Space.SCRATCH, "lora_router_t") and router.arg("KS") == cols
        assert router.arg("lora_b0") == Buf(Space.LAYER, "lora_router_a3")
        assert route.kernel == b_route.kernel.replace("topk_route<", "topk_route_lora<") and route.kernel in names
        assert route.args[:len(b_route.args)] == b_route.args and route.arg("lora_ids") == CallValue.LORA_IDS
        assert route.smem == C.topk_route_lora_smem_bytes(cfg.router_width, 16) <= jit.opt_in_smem(route.kernel, H200.max_smem)
        assert not any(getattr(s, "kernel", "").endswith("router_delta") for s in plan.steps)
    off = build_forward_plan(replace(lp, lora_router_t_rows=0), H200, 300, Path.PREFILL, lora=shape).at(300)
    assert off.steps[1].kernel == "lora_grouped_router_delta"
    need, _ = layer_need(lp, 2000, lora_rank=16, lora_router_t_cols=cols)
    assert need.placements["lora_router_t"].nbytes >= 1024 * cols * 4 * C.ROUTER_MAX_SPLITS
    assert "lora_router_t" not in layer_need(lp, 2000, lora_rank=16)[0].placements


def test_prefill_router_t_not_on_the_wgmma_router():
    """A router on the wgmma GEMM (the math configuration, sm_90a, not row-invariant) keeps the delta launch."""
    from dataclasses import replace

    cfg = preset_config("deepseek-v3")
    lp = plan_layer(cfg, "bf16", "bf16", "sm_90a", knobs=Knobs())
    lp = replace(lp, lora_router_t_rows=65536)
    shape = LoraShape(max_loras=4, max_rank=16)
    n = 16384
    plan = build_forward_plan(lp, H200, n, Path.PREFILL, lora=shape).at(n)
    assert not plan.steps[0].kernel.startswith("grouped_gemm<"), plan.steps[0].kernel
    assert plan.steps[1].kernel == "lora_grouped_router_delta"


def test_router_t_rows_knob():
    assert Knobs.from_env({"CUPYMOE_LORA_ROUTER_T_ROWS": "0"}).lora_router_t_rows == 0
    assert Knobs.from_env({}).lora_router_t_rows is None
    with pytest.raises(OptionError, match="CUPYMOE_LORA_ROUTER_T_ROWS"):
        Knobs.from_env({"CUPYMOE_LORA_ROUTER_T_ROWS": "-1"})


def test_lora_experts_option():
    """MoeLayer(lora_experts=...): None serves the experts but on a w8a8 layer; a bool as given; else refused."""
    from cupymoe.lora_slots import expert_slot_shape, serves_experts

    assert serves_experts(None, False) and not serves_experts(None, True)
    assert serves_experts(True, True) and not serves_experts(False, False)
    for bad in (1, "yes", 0.0):
        with pytest.raises(OptionError, match=r"lora_experts=.*: must be True, False or None"):
            serves_experts(bad, False)
    assert expert_slot_shape([0, 2], 64, False) is None and expert_slot_shape([0, 2], 64, True).table_slots == 3
    from cupymoe import MoeLayer  # refused before anything reaches a GPU, with slots or without

    cfg = testing.tiny_config("qwen2_moe")
    with pytest.raises(OptionError, match="lora_experts='yes'"):
        MoeLayer(cfg, testing.random_host_weights(cfg, __import__("numpy").random.default_rng(0)), max_tokens=4,
                 lora_experts="yes")
    with pytest.raises(OptionError, match=r"lora_experts=True without adapter slots: give max_loras=K"):
        MoeLayer(cfg, testing.random_host_weights(cfg, __import__("numpy").random.default_rng(0)), max_tokens=4,
                 lora_experts=True)


@pytest.mark.parametrize("path, n", [(Path.DECODE, 1), (Path.DECODE, 9), (Path.ATOMIC, 5), (Path.PREFILL, 300),
                                     (Path.PREFILL, 5000)])
def test_experts_only_lora_plan(path, n):
    """The experts-only entry with lora_ids: its given-routing plan with experts_route_in_lora in place of
    experts_route_in (the same arguments, then the rows' slots and their count) and the experts' deltas
    as the routed LoRA plan adds them; no router delta (the caller routes)."""
    cfg = testing.tiny_config("qwen2_moe")
    lp = plan_layer(cfg, "bf16", "bf16", "sm_90a", options=LayerOptions(decode_max_tokens=64), knobs=Knobs())
    base = build_forward_plan(lp, H200, n, path, given_routing=True).at(n)
    plan = build_forward_plan(lp, H200, n, path, given_routing=True, lora=EXPERTS).at(n)
    routed = build_forward_plan(lp, H200, n, path, lora=EXPERTS).at(n)
    kernels = [getattr(s, "kernel", "") for s in plan.steps]
    assert "experts_route_in" not in kernels and not any("router" in k for k in kernels)
    i = kernels.index("experts_route_in_lora")
    assert plan.steps[i].args[:-2] == base.steps[i].args
    assert [a.name for a in plan.steps[i].args[-2:]] == ["lora_ids", "max_loras"]
    assert plan.steps[i].args[-2].value == CallValue.LORA_IDS and plan.steps[i].args[-1].value == EXPERTS.max_loras

    def deltas(p):
        return [(s.kernel, s.args) for s in p.steps
                if getattr(s, "kernel", "").startswith("lora_") and "router" not in s.kernel]

    assert deltas(plan) and deltas(plan) == deltas(routed)
    no_experts = build_forward_plan(lp, H200, n, path, given_routing=True, lora=SHAPE).at(n)
    assert [getattr(s, "kernel", "") for s in no_experts.steps] == [
        "experts_route_in_lora" if k == "experts_route_in" else k for k in (getattr(s, "kernel", "") for s in base.steps)]


@pytest.mark.parametrize("path, n", [(Path.DECODE, 1), (Path.DECODE, 9), (Path.ATOMIC, 5), (Path.PREFILL, 5)])
def test_experts_only_lora_without_the_shared_expert(path, n):
    """forward_experts(shared_expert=False) with lora_ids: the per-pair deltas cover the routed pairs alone
    (the lists hold no shared pair, so a block for one would read another call's pair_pos)."""
    cfg = testing.tiny_config("qwen2_moe")
    lp = plan_layer(cfg, "bf16", "bf16", "sm_90a", options=LayerOptions(decode_max_tokens=64), knobs=Knobs())
    k = cfg.num_experts_per_tok
    for shared, pairs in ((False, n * k), (True, n * (k + 1))):
        plan = build_forward_plan(lp, H200, n, path, given_routing=True, lora=EXPERTS, shared_expert=shared).at(n)
        grids = {s.kernel: s.grid for s in plan.steps if getattr(s, "kernel", "") in ("lora_gate_up_act",
                                                                                       "lora_down_delta")}
        assert len(grids) == 2 and all(g[0] == pairs for g in grids.values()), (shared, grids)


def test_a_rank_past_the_kernels_shared_memory_is_refused_at_construction():
    """max_lora_rank 65536 made lora_gate_up_act and top-k's LoRA form ask 262-524 KB a block: a LaunchError
    mid-forward, after the router was enqueued. Now an OptionError naming both sizes; rank 64 fits."""
    from cupymoe.lora_slots import check_rank_fits

    cfg = testing.tiny_config("qwen3_moe")
    check_rank_fits(cfg, 64, 232448)
    with pytest.raises(OptionError, match=r"max_lora_rank=65536: the LoRA kernels would ask \d+ bytes of shared "
                                          r"memory a block, this GPU gives at most 232448"):
        check_rank_fits(cfg, 65536, 232448)
