"""CPU tests of the LoRA stacked form (cupymoe/lora_stack.py; no GPU needed): the extra-K index
math, Bext's packing and T against numpy models, the GEMM's extra K steps replayed in numpy (the
boxes tma_copy_stage_lora loads, TMA's zero fill past a map's columns), the plans that take the
form, its scratch and its tensor maps."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import jit, lora_stack as LS
from cupymoe.bench import preset_config
from cupymoe.errors import OptionError
from cupymoe.forward_plan import (LORA_MMA_WARPS, LoraShape, build_forward_plan, lora_chunk_blocks, lora_grouped_smem,
                                  lora_kernel_name)
from cupymoe.knobs import Knobs, LoraShrink
from cupymoe.plan import Buf, CallValue, DeviceFacts, LayerOptions, Path, Space, Stage, plan_layer
from cupymoe.formats import BF16
from cupymoe.workspace import layer_need

H200 = DeviceFacts.h200()


@pytest.mark.parametrize("K, R, parts, ks", [(4, 16, 1, 64), (4, 16, 2, 128), (3, 5, 1, 64), (3, 5, 2, 64),
                                              (8, 16, 2, 256), (1, 1, 1, 64), (5, 16, 1, 128)])
def test_stack_width_whole_k_steps(K, R, parts, ks):
    assert LS.stack_width(K, R, parts) == ks and LS.lora_steps(K, R, parts) == ks // 64
    with pytest.raises(ValueError):
        LS.stack_width(K, R, 3)


@pytest.mark.parametrize("K, R, parts", [(4, 16, 2), (3, 5, 1), (3, 5, 2), (1, 1, 2)])
def test_columns_are_a_bijection_onto_parts_k_r(K, R, parts):
    """column(q, a, r) and the kernel's decode (lora_stack_elem) agree; columns past parts K R decode to None."""
    seen = {}
    for q in range(parts):
        for a in range(K):
            for r in range(R):
                c = LS.column(q, a, r, K, R)
                assert LS.decode_column(c, K, R, parts) == (q, a, r)
                seen[c] = (q, a, r)
    assert sorted(seen) == list(range(parts * K * R))
    for u in range(parts * K * R, LS.stack_width(K, R, parts)):
        assert LS.decode_column(u, K, R, parts) is None
    assert LS.slot_columns(K - 1, K, R, parts) == [LS.column(q, K - 1, 0, K, R) for q in range(parts)]


@pytest.mark.parametrize("parts", [1, 2])
def test_stacked_b_against_brute_force(parts):
    rng = np.random.default_rng(0)
    K, S, out, R = 3, 4, 24, 5
    b = rng.standard_normal((K, S, out, R)).astype(np.float32)
    ext = LS.stacked_b(b, parts)
    ks = LS.stack_width(K, R, parts)
    assert ext.shape == (S, out, ks)
    for u in range(ks):
        d = LS.decode_column(u, K, R, parts)
        want = np.zeros((S, out), np.float32) if d is None else b[d[1], :, :, d[2]]
        np.testing.assert_array_equal(ext[:, :, u], want)


@pytest.mark.parametrize("K, R, parts", [(4, 16, 1), (4, 16, 2), (8, 8, 2), (3, 24, 1), (5, 32, 2), (1, 8, 1)])
def test_vector_decode_where_the_rank_is_a_multiple_of_8(K, R, parts):
    """cuda/lora.cu lora_stack_vec's one decode a vector (max_rank % 8 == 0): an 8-column vector of
    gate/up's 2 KS columns lies in one (projection, part, adapter) block, its ranks r0 .. r0 + 7, as
    the element decode (lora_stack_elem) says column by column; past parts K R or another adapter: zeros."""
    ks, kr = LS.stack_width(K, R, parts), K * R
    for c0 in range(0, 2 * ks, 8):
        p = c0 // ks
        u = c0 - p * ks
        q, rem = u // kr, u % kr
        a = rem // R
        for j in range(8):
            assert (u + j) // ks == 0  # the vector stays in projection p
            want = LS.decode_column(u + j, K, R, parts)
            assert (None if u >= parts * kr else (q, a, rem - a * R + j)) == want


def _stack_elem(t_row, u, parts, key, K, R):
    """cuda/lora.cu lora_stack_elem, element by element."""
    d = LS.decode_column(u, K, R, parts)
    if d is None or d[1] != key:
        return np.float32(0)
    v = np.float32(t_row[d[2]])
    hi = np.float32(np.array([v]).astype(BF16).astype(np.float32)[0])
    return np.float32(np.array([hi if d[0] == 0 else v - hi]).astype(BF16).astype(np.float32)[0])


@pytest.mark.parametrize("parts", [1, 2])
def test_stacked_t_against_the_kernels_element_rule(parts):
    rng = np.random.default_rng(1)
    K, R, P = 4, 5, 9
    t = rng.standard_normal((P, R)).astype(np.float32)
    lid = np.array([0, 3, -1, 4, 2, 2, 1, 0, 7])  # -1 and ids past the slots: zero rows
    T = LS.stacked_t(t, lid, K, R, parts)
    for i in range(P):
        for u in range(T.shape[1]):
            assert T[i, u] == _stack_elem(t[i], u, parts, lid[i] if 0 <= lid[i] < K else -2, K, R)
    assert not T[2].any() and not T[3].any() and not T[8].any()


def _replay_gate_up(Tgu, bg, bu, ks, bn2):
    """The accumulator of a gate/up tile over the extra K steps, as tma_copy_stage_lora loads them:
    step j: A = T columns 64 j .. 64 j + 63; the gate half reads gate's Bext at k = 64 j, the up
    half up's at k = 64 j - KS (or KS + 64 j before KS), columns past a map's KS arriving as zeros."""
    def box(m, k):  # a 64-column box of map m ([rows, KS]) at column k, zeros past its extent
        out = np.zeros((m.shape[0], 64), np.float64)
        lo, hi = max(k, 0), min(k + 64, m.shape[1])
        if lo < hi:
            out[:, lo - k:hi - k] = m[:, lo:hi]
        return out
    acc = np.zeros((Tgu.shape[0], 2 * bn2))
    for j in range(2 * ks // 64):
        kg = 64 * j
        ku = kg + ks if kg < ks else kg - ks
        a = Tgu[:, kg:kg + 64].astype(np.float64)
        acc[:, :bn2] += a @ box(bg, kg).T
        acc[:, bn2:] += a @ box(bu, ku).T
    return acc


@pytest.mark.parametrize("K, R, parts", [(4, 16, 1), (4, 16, 2), (3, 5, 2), (2, 1, 1)])
def test_extra_k_steps_give_the_deltas(K, R, parts):
    """T Bext over the GEMM's extra steps = s B t of each row's own adapter, for gate's and up's
    columns alike (the other projection's half zero-filled), nothing for rows without one; two
    parts keep s t to ~2^-16, one part to bf16's 2^-8."""
    rng = np.random.default_rng(2)
    P, out, S = 40, 32, 3
    e = 1  # the tile's table slot
    lid = rng.integers(-1, K + 1, P)
    tg, tu = (rng.standard_normal((P, R)).astype(np.float32) for _ in range(2))
    bg, bu = (rng.standard_normal((K, S, out, R)).astype(np.float32).astype(BF16).astype(np.float32)
              for _ in range(2))
    Tgu = np.concatenate([LS.stacked_t(tg, lid, K, R, parts), LS.stacked_t(tu, lid, K, R, parts)], axis=1)
    ks = LS.stack_width(K, R, parts)
    acc = _replay_gate_up(Tgu, LS.stacked_b(bg, parts)[e], LS.stacked_b(bu, parts)[e], ks, out)
    tol = 2.0 ** -15 if parts == 2 else 2.0 ** -8
    for i in range(P):
        a = lid[i]
        if not 0 <= a < K:
            assert not acc[i].any()
            continue
        for half, (t, b) in enumerate(((tg, bg), (tu, bu))):
            want = b[a, e].astype(np.float64) @ t[i].astype(np.float64)
            got = acc[i, half * out:(half + 1) * out]
            scale = np.abs(b[a, e]).astype(np.float64) @ np.abs(t[i]).astype(np.float64)
            assert np.all(np.abs(got - want) <= tol * scale + 1e-30)


def test_knob_parses_parts():
    assert Knobs.from_env({}).lora_in_gemm == 1
    assert Knobs.from_env({"CUPYMOE_LORA_IN_GEMM": "2"}).lora_in_gemm == 2
    with pytest.raises(OptionError, match="CUPYMOE_LORA_IN_GEMM"):
        Knobs.from_env({"CUPYMOE_LORA_IN_GEMM": "3"})


def test_knob_parses_the_shrink_form():
    assert Knobs.from_env({}).lora_stack_shrink == LoraShrink.AUTO
    assert Knobs.from_env({"CUPYMOE_LORA_STACK_SHRINK": "chunks"}).lora_stack_shrink == LoraShrink.CHUNKS
    assert Knobs.from_env({"CUPYMOE_LORA_STACK_SHRINK": "segments"}).lora_stack_shrink == LoraShrink.SEGMENTS
    assert Knobs.from_env({"CUPYMOE_LORA_STACK_SHRINK": "experts"}).lora_stack_shrink == LoraShrink.EXPERTS
    with pytest.raises(OptionError, match="CUPYMOE_LORA_STACK_SHRINK"):
        Knobs.from_env({"CUPYMOE_LORA_STACK_SHRINK": "dense"})


@pytest.mark.parametrize("base, want", [("grouped_gemm_sm90_tma<0, 4, 256, 1, 1>", "<0, 4, 256, 1, 1, 2>"),
                                        ("grouped_gemm_sm90_tma<1, 4, 256, 1, 0, 3>", "<1, 4, 256, 1, 0, 3>"),
                                        ("grouped_gemm_sm90_tma<0, 3, 128, 2>", "<0, 3, 128, 2, 0, 2>")])
def test_lora_kernel_names_are_compiled(base, want):
    names = jit.MODULES["grouped_sm90_tma"].names
    assert base in names and lora_kernel_name(base) == "grouped_gemm_sm90_tma_lora" + want
    assert lora_kernel_name(base) in names


def _plans(preset, n, parts, row_invariant=False):
    cfg = preset_config(preset)
    # the TMA GEMMs (128-row tiles) at every N, whatever the tuning table picks for the bucket
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, H200.arch,
                    options=LayerOptions(row_invariant=row_invariant), knobs=Knobs(math_rows=1), table={})
    today = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, True)).at(n)
    stacked = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, True, parts)).at(n)
    return cfg, lp, today, stacked


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("n, parts", [(300, 1), (1100, 2), (4096, 1)])
def test_stacked_plan(preset, n, parts):
    """Each TMA GEMM becomes grouped_gemm_sm90_tma_lora (lora_steps past its arguments, act_code
    its own: no ACT_PAIR, no lora_gu), its shrink right before it over its tile list, and no
    delta kernel after: every other launch is the router-LoRA plan's."""
    cfg, lp, today, plan = _plans(preset, n, parts)
    base = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, False)).at(n)
    names = {k for m in jit.modules_for("sm_90a") for k in jit.MODULES[m].names}
    kinds = [getattr(s, "kernel", None) for s in plan.steps]
    assert "lora_grouped_gate_up_act" in [getattr(s, "kernel", None) for s in today.steps]
    assert not {"lora_grouped_gate_up_act", "lora_grouped_down_delta"} & set(kinds)
    assert all(k in names for k in kinds if k)
    gemms = [s for s in base.steps if getattr(s, "kernel", "").startswith("grouped_gemm_sm90_tma<")]
    assert len(gemms) == 2
    for g in gemms:
        i = next(i for i, s in enumerate(plan.steps) if getattr(s, "kernel", "") == lora_kernel_name(g.kernel)
                 and s.stage == g.stage)
        s, shrink = plan.steps[i], plan.steps[i - 1]
        assert s.args == g.args + (s.args[-1],) and s.args[-1].name == "lora_steps"
        assert s.arg("lora_steps") == LS.lora_steps(4, 16, parts)
        assert (s.grid, s.block, s.smem) == (g.grid, g.block, g.smem)
        assert s.pdl and not shrink.pdl and not g.pdl  # lora_overlap: by PDL after its shrink, launched plainly
        # CUPYMOE_LORA_STACK_SHRINK=auto (heuristics.lora_shrink_form): by segments past 2048 rows; below,
        # by expert pieces where the shrink's K is at most 2048 (qwen3-30b-a3b's H and I; deepseek-v3's I)
        k = cfg.hidden_size if g.stage == Stage.GATE_UP else lp.i_max
        seg = "lora_stack_t_seg<2, 32>" if g.stage == Stage.GATE_UP else "lora_stack_t_seg<1, 16>"
        if n > 2048:
            assert shrink.kernel == seg
            assert shrink.stage == g.stage and shrink.grid == (g.grid[1], 4) and shrink.block == (128,)
        elif k <= 2048:
            assert shrink.kernel == seg.replace("seg<", "seg_experts<") and shrink.block == (128,)
            assert shrink.grid == (min(lp.n_local, n * cfg.num_experts_per_tok) + int(cfg.has_shared_expert), 4,
                                   -(-n // 768))
        else:
            # the TMA GEMM's 128 / 192-row tiles: a tile a block (runs are grouped.cu's 64-row tiles')
            assert shrink.kernel == ("lora_stack_t_gate_up" if g.stage == Stage.GATE_UP else "lora_stack_t_down")
            assert shrink.stage == g.stage and shrink.grid == (g.grid[1], lora_chunk_blocks(4))
            assert shrink.block == (LORA_MMA_WARPS * 32,)
            assert shrink.smem == lora_grouped_smem(16, g.stage == Stage.GATE_UP)
        if not shrink.kernel.startswith("lora_stack_t_seg_experts"):
            assert (shrink.arg("num_tiles"), shrink.arg("tile_info")) == (g.arg("num_tiles"), g.arg("tile_info"))
        assert shrink.arg("lora_ids") == CallValue.LORA_IDS and shrink.arg("parts") == parts
        assert shrink.arg("KS") == LS.stack_width(4, 16, parts)
        assert shrink.arg("T") == Buf(Space.SCRATCH, "lora_t_gu" if g.stage == Stage.GATE_UP else "lora_t_down")
    rest = [s for s in plan.steps if not getattr(s, "kernel", "").startswith(("lora_stack_t", "grouped_gemm_sm90"))]
    assert rest == [s for s in base.steps if s not in gemms]  # the router-LoRA plan's other launches, in order


def _launches_that_differ(a, b, prefix: str) -> list:
    """The (a's, b's) launch pairs whose a-kernel starts with `prefix`; every other step of the two
    plans is the same."""
    assert len(a.steps) == len(b.steps)
    pairs = []
    for old, new in zip(a.steps, b.steps):
        if getattr(old, "kernel", "").startswith(prefix):
            pairs.append((old, new))
        else:
            assert new == old
    return pairs


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("K, R", [(4, 16), (8, 16), (2, 32), (4, 5)])
def test_stacked_plan_with_the_shrink_segments(preset, K, R):
    """CUPYMOE_LORA_STACK_SHRINK=segments: each shrink is lora_stack_t_seg<NP, BN> over its GEMM's
    tile list, a block a (tile, adapter slot), BN the least of 16 / 32 / 64 holding NP R columns, the
    layer's A matrices and the same T; the rest of the plan is the chunks form's."""
    cfg = preset_config(preset)
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, H200.arch,
                    options=LayerOptions(), knobs=Knobs(math_rows=1), table={})
    n = 1100
    chunks = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(K, R, True, 1, LoraShrink.CHUNKS)).at(n)
    plan = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(K, R, True, 1, LoraShrink.SEGMENTS)).at(n)
    names = {k for m in jit.modules_for("sm_90a") for k in jit.MODULES[m].names}
    pairs = _launches_that_differ(chunks, plan, "lora_stack_t_")
    for old, new in pairs:
        gu = old.stage == Stage.GATE_UP
        np_ = 2 if gu else 1
        bn = next(b for b in (16, 32, 64) if np_ * R <= b)
        assert new.kernel == f"lora_stack_t_seg<{np_}, {bn}>" and new.kernel in names
        assert new.grid == (old.grid[0], K) and new.block == (128,) and not new.pdl  # the kernel has no PDL wait
        assert new.smem == 4 * (64 + bn) * 64 * 2 == jit.opt_in_smem(new.kernel, 227 * 1024)
        for a in ("num_tiles", "tile_info", "lora_ids", "sorted_row", "T", "KS", "parts", "max_rank", "max_loras"):
            assert new.arg(a) == old.arg(a), a
        want = ("lora_gate_a", "lora_up_a") if gu else ("lora_down_a", None)
        assert new.arg("a0") == Buf(Space.LAYER, want[0])
        assert new.arg("a1") == (Buf(Space.LAYER, want[1]) if gu else 0)
    assert len(pairs) == 2


@pytest.mark.parametrize("preset, n", [("qwen3-30b-a3b", 1100), ("qwen3-30b-a3b", 4096), ("qwen3-next-80b", 4096)])
def test_stacked_plan_with_the_shrink_by_experts(preset, n):
    """CUPYMOE_LORA_STACK_SHRINK=experts: each shrink is lora_stack_t_seg_experts<NP, BN> over the sort's
    active runs, grid (the active experts' bound, slots, ceil(N / 768) pieces: the shared expert's run
    of N rows in several), the segments form's other arguments; the grid a value of N in the bucket plan."""
    cfg = preset_config(preset)
    lp = plan_layer(cfg, "bf16", "bf16" if cfg.has_shared_expert else None, H200.arch,
                    options=LayerOptions(), knobs=Knobs(math_rows=1), table={})
    lora = LoraShape(4, 16, True, 1, LoraShrink.EXPERTS)
    seg = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, True, 1, LoraShrink.SEGMENTS)).at(n)
    bucket = build_forward_plan(lp, H200, n, Path.PREFILL, lora=lora)
    plan = bucket.at(n)
    names = {k for m in jit.modules_for("sm_90a") for k in jit.MODULES[m].names}
    sh = int(cfg.has_shared_expert)
    pairs = _launches_that_differ(seg, plan, "lora_stack_t_seg<")
    for old, new in pairs:
        assert new.kernel == old.kernel.replace("lora_stack_t_seg<", "lora_stack_t_seg_experts<") and new.kernel in names
        assert new.grid == (min(lp.n_local, n * cfg.num_experts_per_tok) + sh, 4, -(-n // 768))
        assert (new.block, new.smem, new.pdl) == (old.block, old.smem, old.pdl)
        assert [a.name for a in new.args if a.name.startswith(("num_", "active_", "tile_"))] == [
            "num_active", "active_slot", "active_start", "active_len"]
        for a in old.args:
            if a.name not in ("num_tiles", "tile_info"):
                assert new.arg(a.name) == a.value, a.name
    assert len(pairs) == 2
    m = n - 37  # a row count in the same bucket
    grids = {s.grid for s in bucket.at(m).steps if s.kernel.startswith("lora_stack_t_seg_experts<")}
    assert grids == {(min(lp.n_local, m * cfg.num_experts_per_tok) + sh, 4, -(-m // 768))}


def test_the_catalog_mirrors_the_segment_kernels_rows():
    """catalog.LORA_SEG_PIECE_ROWS (the expert pieces' grid) and forward_plan.LORA_SUB are cuda/lora.cu's."""
    from _kernel_source import define

    from cupymoe.catalog import LORA_SEG_PIECE_ROWS
    from cupymoe.forward_plan import LORA_SUB

    src = (jit.kernel_dir() / "lora.cu").read_text()
    assert define(src, "LSS_PIECE") == LORA_SEG_PIECE_ROWS and define(src, "LORA_SUB") == LORA_SUB
    assert LORA_SEG_PIECE_ROWS % LORA_SUB == 0


def test_the_segments_width_refuses_past_64_columns():
    from cupymoe.catalog import lora_seg_bn

    assert [lora_seg_bn(2, r) for r in (1, 8, 9, 16, 17, 32)] == [16, 16, 32, 32, 64, 64]
    assert [lora_seg_bn(1, r) for r in (5, 16, 17, 32, 33)] == [16, 16, 32, 32, 64]
    with pytest.raises(ValueError, match="NP=2, max_rank=33"):
        lora_seg_bn(2, 33)


@pytest.mark.parametrize("n, segments", [(300, False), (2048, False), (2049, True), (16384, True)])
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
def test_auto_takes_the_segments_past_2048_rows(preset, n, segments):
    """CUPYMOE_LORA_STACK_SHRINK=auto: segments past 2048 rows; below them expert pieces where the
    shrink's K is at most 2048 columns (qwen3-30b-a3b's H 2048 and I 768, deepseek-v3's I 2048), chunks
    where it is longer (deepseek-v3's H 7168); the prefill shapes split at 2049, so a bucket plan never
    spans both."""
    from cupymoe.forward_plan import prefill_shape

    cfg, lp, _, plan = _plans(preset, n, 1)
    kinds = {getattr(s, "kernel", "") for s in plan.steps}
    want = {Stage.GATE_UP: LoraShrink.SEGMENTS if segments else
            LoraShrink.EXPERTS if cfg.hidden_size <= 2048 else LoraShrink.CHUNKS,
            Stage.DOWN: LoraShrink.SEGMENTS if segments else LoraShrink.EXPERTS}
    assert want[Stage.GATE_UP] == (LoraShrink.SEGMENTS if segments else
                                   LoraShrink.EXPERTS if preset == "qwen3-30b-a3b" else LoraShrink.CHUNKS)
    names = {LoraShrink.SEGMENTS: "lora_stack_t_seg<{}, {}>", LoraShrink.EXPERTS: "lora_stack_t_seg_experts<{}, {}>"}
    for stage, np_, bn, chunks in ((Stage.GATE_UP, 2, 32, "lora_stack_t_gate_up"), (Stage.DOWN, 1, 16, "lora_stack_t_down")):
        form = want[stage]
        assert (names.get(form, chunks).format(np_, bn) in kinds) and ((chunks in kinds) == (form == LoraShrink.CHUNKS))
    shape = prefill_shape(lp, H200, n)
    assert (shape.lora_gate_up_shrink, shape.lora_down_shrink) == (want[Stage.GATE_UP], want[Stage.DOWN])


def test_stacked_form_only_where_it_serves():
    """Off without Bext (stack_parts 0), below the grouped deltas' rows (one-block sort), and for a
    row-invariant layer (no TMA GEMM there): those plans are today's."""
    for n, ri in ((64, False), (1100, True)):
        _, _, today, plan = _plans("qwen3-30b-a3b", n, 1, ri)
        assert plan.steps == today.steps
    cfg = preset_config("qwen3-30b-a3b")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(), knobs=Knobs())
    a = build_forward_plan(lp, H200, 1100, Path.PREFILL, lora=LoraShape(4, 16, True)).at(1100)
    b = build_forward_plan(lp, H200, 1100, Path.PREFILL, lora=LoraShape(4, 16, True, 0)).at(1100)
    assert a.steps == b.steps


def test_stacked_scratch_after_every_other_buffer():
    cfg = preset_config("qwen3-30b-a3b")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(), knobs=Knobs())
    T, ks = 1100, LS.stack_width(4, 16, 2)
    base, _ = layer_need(lp, T, lora_experts=True, lora_rank=16)
    with_t, _ = layer_need(lp, T, lora_experts=True, lora_rank=16, lora_stack_ks=ks)
    P = T * cfg.num_experts_per_tok
    assert with_t.placements["lora_t_gu"].nbytes == P * 2 * ks * 2
    assert with_t.placements["lora_t_down"].nbytes == P * ks * 2
    assert {k: v for k, v in with_t.placements.items() if not k.startswith("lora_t_")} == base.placements


class _Scratch:
    def __init__(self, sizes):
        self.sizes = sizes

    def ptr(self, name):
        return 1 << 20 if name == "lora_t_gu" else 2 << 20

    def nbytes(self, name):
        return self.sizes[name]


class _Slots:
    class experts:
        table_slots = 129

    stack_width = 128

    def ptr(self, name):
        return {"lora_gate_bx": 3 << 20, "lora_up_bx": 4 << 20, "lora_down_bx": 5 << 20}[name]


def test_lora_maps_span_t_and_bext():
    from cupymoe import tma

    cfg = preset_config("qwen3-30b-a3b")
    lp = plan_layer(cfg, "bf16", None, H200.arch, options=LayerOptions(), knobs=Knobs())
    assert tma.TMA_MAPS[10:] == ("lora_t_gu", "lora_t_down", "lora_b_gate", "lora_b_up", "lora_b_down")
    assert tma.lora_maps(lp, None, None) == [None] * 5
    P, ks = 8800, 128
    maps = tma.lora_maps(lp, _Scratch({"lora_t_gu": P * 2 * ks * 2, "lora_t_down": P * ks * 2}), _Slots())
    (tg, bt), (td, bd), (g, bg), (u, bu), (d, bdn) = maps
    assert (tg.rows, tg.cols, td.rows, td.cols, bt, bd) == (P, 2 * ks, P, ks, 64, 64)
    assert (g.rows, g.cols, u.rows, d.rows, d.cols) == (129 * lp.i_max, ks, 129 * lp.i_max, 129 * cfg.hidden_size, ks)
    from cupymoe.catalog import GemmMode
    assert (bg, bu, bdn) == (lp.sm90[GemmMode.GATE_UP].bn // 2, lp.sm90[GemmMode.GATE_UP].bn // 2,
                             lp.sm90[GemmMode.DOWN].bn)


def _kernel_params(src: str, name: str) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of __global__ `name` in `src` (kind: ptr, int, float), an
    argument-list macro (GEMM_ARGS from gemm_common.cuh; TOPK_ROUTE_ARGS, ROUTE_IN_ARGS of topk.cu)
    expanded from its definition."""
    import re

    m = re.search(r"__global__[^;{]*?\b" + name + r"\(([^)]*)\)\s*\{", src, re.S)
    assert m, name
    params = m.group(1)
    common = (jit.kernel_dir() / "gemm_common.cuh").read_text()
    for macro in set(re.findall(r"\b[A-Z_]+_ARGS\b", params)):
        where = src if f"#define {macro}" in src else common
        body = re.search(rf"#define {macro}\s+((?:[^\n]*\\\n)*[^\n]*)", where).group(1).replace("\\", " ")
        params = params.replace(macro, body)
    out = []
    for p in params.split(","):
        p = " ".join(p.split())
        ident = re.findall(r"\w+", p)[-1]
        out.append((ident, "ptr" if "*" in p else "float" if p.startswith("float") else "int"))
    return out


def test_stacked_launches_match_the_kernels_parameters():
    """Each stacked-form launch passes the kernel's parameters in order, by name and by kind (u64 for a
    pointer, i32 for an int, f32 for a float): NVRTC cannot check what the plan packs. So do the
    router's LoRA form's (grouped_gemm_lora<2, ...>, topk_route_lora), the experts-only entry's
    (experts_route_in and its LoRA form) and both gate/up chunk shrinks."""
    from dataclasses import replace

    from cupymoe.forward_plan import lora_router_t_rows
    from cupymoe.plan import ArgType

    kinds = {ArgType.U64: "ptr", ArgType.I32: "int", ArgType.F32: "float"}
    srcs = {"lora_stack_t": (jit.kernel_dir() / "lora.cu").read_text(),
            "grouped_gemm_sm90_tma_lora": (jit.kernel_dir() / "grouped_sm90_tma.cu").read_text(),
            "grouped_gemm_lora": (jit.kernel_dir() / "grouped.cu").read_text(),
            "topk_route_lora": (jit.kernel_dir() / "topk.cu").read_text(),
            "experts_route_in": (jit.kernel_dir() / "topk.cu").read_text()}
    seen = set()
    plans = [_plans(p, 1100, 1)[3] for p in ("qwen3-30b-a3b", "deepseek-v3")]
    plans += [_w8a16_plan(p, 1100, 1) for p in ("qwen3-30b-a3b", "deepseek-v3")]
    plans += [_w8a16_plan(p, 1100, 1, LoraShrink.SEGMENTS) for p in ("qwen3-30b-a3b", "deepseek-v3")]
    for p in ("qwen3-30b-a3b", "deepseek-v3"):  # the router's LoRA form
        lp = _plans(p, 1000, 1)[1]
        lp = replace(lp, lora_router_t_rows=lora_router_t_rows(lp, None, 4, 16))
        plans.append(build_forward_plan(lp, H200, 1000, Path.PREFILL, lora=LoraShape(4, 16, True, 1)).at(1000))
        for lora in (None, LoraShape(4, 16, True, 1)):  # the experts-only entry's
            plans.append(build_forward_plan(lp, H200, 5, Path.DECODE, given_routing=True, lora=lora).at(5))
    for plan in plans:
        for s in plan.steps:
            k = getattr(s, "kernel", "")
            base = k.split("<")[0]
            src = next((v for p, v in srcs.items() if base.startswith(p)), None)
            if src is None:
                continue
            seen.add(base)
            want = _kernel_params(src, base)
            got = [(a.name, kinds[a.type]) for a in s.args]
            assert got == want, k
    assert seen == {"lora_stack_t_gate_up", "lora_stack_t_gate_up_runs", "lora_stack_t_down", "lora_stack_t_seg",
                    "lora_stack_t_seg_experts",
                    "grouped_gemm_sm90_tma_lora", "grouped_gemm_lora", "topk_route_lora", "experts_route_in",
                    "experts_route_in_lora"}


def _w8a16_plan(preset, n, parts, shrink=LoraShrink.CHUNKS):
    cfg = preset_config(preset)
    lp = plan_layer(cfg, "fp8_block", None, H200.arch, options=LayerOptions(fp8_compute="w8a16"), knobs=Knobs())
    return build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, True, parts, shrink)).at(n)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("n, parts", [(1100, 1), (4096, 2)])
def test_stacked_w8a16_plan(preset, n, parts):
    """A w8a16 layer (fp8 experts, bf16 activations: grouped.cu's GEMMs) holds Bext and runs each
    GEMM as grouped_gemm_lora with T, gate's / down's Bext, up's and KS past its own arguments,
    after the shrink; a w8a8 layer has no stacked form (no expert adapters)."""
    from cupymoe.catalog import lora_grouped_kernel
    from cupymoe.forward_plan import lora_stack_parts, stacked_gemms

    cfg = preset_config(preset)
    lp = plan_layer(cfg, "fp8_block", None, H200.arch, options=LayerOptions(fp8_compute="w8a16"), knobs=Knobs())
    assert stacked_gemms(lp) and lora_stack_parts(lp, parts, 4, 16) == parts
    w8a8 = plan_layer(cfg, "fp8_block", None, H200.arch, options=LayerOptions(fp8_compute="w8a8"), knobs=Knobs())
    assert not stacked_gemms(w8a8) and lora_stack_parts(w8a8, parts, 4, 16) == 0
    base = build_forward_plan(lp, H200, n, Path.PREFILL, lora=LoraShape(4, 16, False)).at(n)
    plan = _w8a16_plan(preset, n, parts)
    gemms = [s for s in base.steps if getattr(s, "kernel", "").startswith("grouped_gemm<") and s.stage != Stage.ROUTER]
    assert len(gemms) == 2
    for g in gemms:
        i = next(i for i, s in enumerate(plan.steps) if getattr(s, "kernel", "") == lora_grouped_kernel(g.kernel))
        s, shrink = plan.steps[i], plan.steps[i - 1]
        gu = g.stage == Stage.GATE_UP
        assert s.args[:len(g.args)] == g.args and (s.grid, s.block, s.smem) == (g.grid, g.block, g.smem)
        assert [a.name for a in s.args[len(g.args):]] == ["lora_t", "lora_b0", "lora_b1", "KS"]
        assert s.arg("lora_t") == Buf(Space.SCRATCH, "lora_t_gu" if gu else "lora_t_down")
        b0, b1 = ("lora_gate_bx", "lora_up_bx") if gu else ("lora_down_bx", "lora_down_bx")
        assert (s.arg("lora_b0"), s.arg("lora_b1")) == (Buf(Space.LAYER, b0), Buf(Space.LAYER, b1))
        assert s.arg("KS") == LS.stack_width(4, 16, parts)
        assert shrink.kernel == ("lora_stack_t_gate_up_runs" if gu else "lora_stack_t_down")
    kinds = {getattr(s, "kernel", None) for s in plan.steps}
    assert not {"lora_grouped_gate_up_act", "lora_grouped_down_delta"} & kinds


@pytest.mark.parametrize("K, R, parts, want", [(4, 16, 1, 1), (4, 16, 2, 2), (8, 16, 1, 1), (4, 32, 1, 1),
                                               (16, 16, 1, 0), (4, 32, 2, 0), (4, 48, 1, 0), (8, 64, 1, 0)])
def test_the_stacked_form_only_where_a_gemm_may_run_it(K, R, parts, want):
    """Bext and T only where the stacked form can run: a rank the grouped kernels serve (past 32 the
    per-pair kernels serve it alone) and at most LORA_STACK_MAX_WIDTH columns of extra K; never on
    a row-invariant or non-TMA layer."""
    from cupymoe.forward_plan import lora_stack_parts

    cfg = preset_config("qwen3-30b-a3b")
    h200 = DeviceFacts.h200()
    lp = plan_layer(cfg, "bf16", None, h200.arch, options=LayerOptions(), knobs=Knobs())
    assert lp.tma
    assert lora_stack_parts(lp, parts, K, R) == want
    assert lora_stack_parts(lp, 0, K, R) == 0
    ri = plan_layer(cfg, "bf16", None, h200.arch, options=LayerOptions(row_invariant=True), knobs=Knobs())
    assert lora_stack_parts(ri, parts, K, R) == 0
    a100 = plan_layer(cfg, "bf16", None, "sm_80", options=LayerOptions(), knobs=Knobs())
    assert lora_stack_parts(a100, parts, K, R) == 0
