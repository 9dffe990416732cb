"""Building a forward's launches: (layer plan, device facts, N, path) -> ForwardPlan.

A pure function: no device, no addresses. The decode paths get one plan a row count; the
prefill path one plan a PrefillShape (the row counts whose launches differ only in values
of N: grids, counts, shared memory), with those values as PerN. The stages, in order:

  router   logits of every row (decode: a CUDA-core or tensor-core GEMV; prefill: a grouped GEMM)
  topk     scoring and selection; on the decode path with few rows, the expert lists too
  norm     the pre-expert RMSNorm (families that have one)
  sort     (row, slot) pairs grouped by expert (one block for few pairs, else three passes)
  gate_up  the experts' gate and up projections with the activation fused
  down     the down projections (decode: fp32 rows; prefill: weighted bf16 rows; atomic: summed)
  reduce   the weighted sum of each row's experts, the shared expert and the identity experts
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from . import catalog as C
from . import heuristics as HX
from .catalog import Activation, GemmMode, LoraDownMode, Scoring, WeightFormat
from .errors import LoraError
from .knobs import LoraDownSplit, LoraShrink, LoraSwapab
from .tuning import bucket_start
from .workspace import LORA_TICKETS, lora_part_floats
from .plan import (AllReduce, Arg, ArgType, Buf, CallValue, DeviceFacts, ForwardPlan, Launch, LayerPlan, Memset,
                   Path, PerN, Space, Stage)

X, OUT, TOKEN_IDS = CallValue.INPUT, CallValue.OUTPUT, CallValue.TOKEN_IDS


def W(name: str) -> Buf:
    return Buf(Space.WEIGHTS, name)


def S(name: str) -> Buf:
    return Buf(Space.SCRATCH, name)


def u64(name: str, v) -> Arg:
    return Arg(name, ArgType.U64, v)


def i32(name: str, v) -> Arg:
    return Arg(name, ArgType.I32, v)


def f32(name: str, v) -> Arg:
    return Arg(name, ArgType.F32, v)


ERR = Buf(Space.LAYER, "err")
TMA_MAPS = Buf(Space.LAYER, "tma_maps")
SWAPAB_MAPS = Buf(Space.LAYER, "swapab_maps")  # the swap-AB decode's weight maps (cupymoe/tma.py swapab_table)
FP8_MAPS = Buf(Space.LAYER, "fp8_maps")  # the w8a8 TMA GEMM's maps (cupymoe/tma.py fp8_table)
LIST_OUTPUTS = ("num_active", "active_slot", "active_start", "active_len", "sorted_row", "sorted_pair", "pair_pos",
                "slot_active")


@dataclass(frozen=True)
class PrefillShape:
    """What fixes a prefill plan's launches: equal shapes share one plan."""

    router_config: str
    router_splits: int
    one_block_sort: bool
    grouped_config: str
    fp8_variant: str = "cp_async"  # the w8a8 grouped GEMM (heuristics.sm90_fp8_variant)
    sm90_gate_up: Optional[str] = None  # the bf16 TMA GEMM variants where the table names them (heuristics.sm90_variant)
    sm90_down: Optional[str] = None
    lora_router_t: bool = False  # the router's LoRA t from the router GEMM (n <= lp.lora_router_t_rows; lora_router_t)
    # the stacked LoRA shrinks' forms where the knob is auto (heuristics.lora_shrink_form)
    lora_gate_up_shrink: LoraShrink = LoraShrink.CHUNKS
    lora_down_shrink: LoraShrink = LoraShrink.CHUNKS


def prefill_shape(lp: LayerPlan, dev: DeviceFacts, n: int) -> PrefillShape:
    cfg = lp.cfg
    rk = HX.grouped_kernel(lp, dev, GemmMode.ROUTER, HX.router_config(lp, dev, n))
    splits = HX.router_splits(lp, dev, -(-cfg.router_width // rk.bn) * -(-n // rk.bm))
    pairs = n * cfg.num_experts_per_tok
    lists_smem = C.build_lists_smem_bytes(pairs, lp.n_local, cfg.router_width)
    return PrefillShape(HX.router_config(lp, dev, n), splits,
                        pairs <= C.SMALL_SORT_PAIRS and lists_smem <= dev.max_smem, HX.grouped_config(lp, n),
                        HX.sm90_fp8_variant(lp, n), HX.sm90_variant(lp, GemmMode.GATE_UP, n),
                        HX.sm90_variant(lp, GemmMode.DOWN, n), n <= lp.lora_router_t_rows,
                        HX.lora_shrink_form(n, cfg.hidden_size), HX.lora_shrink_form(n, lp.i_max))


def decode_lists_in_one_block(lp: LayerPlan, dev: DeviceFacts, n: int) -> bool:
    """Whether the decode and atomic paths' expert lists of `n` rows are one decode_build_lists launch
    (which also makes slot_active) rather than the three-pass sort: to SMALL_SORT_PAIRS pairs where
    its shared memory fits, past them (several pairs a thread, up to lp.decode_sort_pairs) only where
    its table stays within STATIC_SMEM_LIMIT, past which it measured slower than the three passes
    (DECISIONS "The decode path's lists in one block past 1024 pairs")."""
    pairs = n * lp.cfg.num_experts_per_tok
    smem = C.build_lists_smem_bytes(pairs, lp.n_local, lp.cfg.router_width)
    if pairs <= C.SMALL_SORT_PAIRS:
        return smem <= dev.max_smem
    return pairs <= lp.decode_sort_pairs and smem <= C.STATIC_SMEM_LIMIT


def prefill_buckets(lp: LayerPlan, dev: DeviceFacts, lo: int, hi: int) -> list[tuple[int, int, PrefillShape]]:
    """The runs of row counts lo..hi of equal PrefillShape, as (first, last, shape). Each part of a
    shape is monotone in N within a router configuration and a tuning-table bucket, so within
    each such bucket a shape's row counts form one run, found by bisection; equal neighbours merge."""
    out: list[tuple[int, int, PrefillShape]] = []
    for a, b in _table_segments(lp, lo, hi):
        for run in _shape_runs(lp, dev, a, b):
            if out and out[-1][2] == run[2] and out[-1][1] + 1 == run[0]:
                out[-1] = (out[-1][0], run[1], run[2])
            else:
                out.append(run)
    return out


def _table_segments(lp: LayerPlan, lo: int, hi: int) -> list[tuple[int, int]]:
    """lo..hi cut where a tuning-table bucket of the layer starts or ends (b/2 < N <= b; 2m/3 < N <= m)."""
    cuts = sorted({c for b, _ in lp.tuned for c in (bucket_start(b), b) if lo <= c < hi})
    starts = [lo] + [c + 1 for c in cuts]
    return list(zip(starts, cuts + [hi]))


def _shape_runs(lp: LayerPlan, dev: DeviceFacts, lo: int, hi: int) -> list[tuple[int, int, PrefillShape]]:
    out = []
    while lo <= hi:
        shape = prefill_shape(lp, dev, lo)
        a, b = lo, hi  # the last N of this run lies in a..b
        while a < b:
            mid = (a + b + 1) // 2
            if prefill_shape(lp, dev, mid) == shape:
                a = mid
            else:
                b = mid - 1
        out.append((lo, a, shape))
        lo = a + 1
    return out


def build_forward_plan(lp: LayerPlan, dev: DeviceFacts, n: int, path: Path, *, separated: bool = False,
                       lora: Optional[LoraShape] = None, given_routing: bool = False,
                       shared_expert: bool = True) -> ForwardPlan:
    """The launches of a forward of `n` rows on `path`. `separated`: stage events or profile
    syncs stand between the kernels, so none goes by programmatic dependent launch. `lora`:
    the LoRA plan variant (the router's delta added to the logits before top-k; the experts'
    deltas where the slots hold them). `given_routing` (the experts-only entry): no router and no
    routing kernel; experts_route_in takes the call's expert ids and weights (CallValue.TOPK_IDS /
    TOPK_WEIGHTS) into the scratch routing writes, and every later stage is the routed plan's
    (with `lora`: the experts' deltas alone, the caller's routing standing for the router's).
    `shared_expert=False` leaves a layer's shared expert out of the lists, the expert launches and
    the reduce."""
    b = _Builder(lp, dev, n, Path(path), separated)
    b.given_routing = given_routing
    b.has_shared = lp.has_shared if shared_expert else 0
    plan = b.build()
    return plan if lora is None else with_lora(plan, lp, lora, separated=separated, given_routing=given_routing,
                                               has_shared=b.has_shared)


@dataclass(frozen=True)
class LoraShape:
    """What a LoRA plan needs of the layer's reserved adapter slots. `experts`: the routed and
    shared experts' deltas too (their slots exist), not only the router's."""

    max_loras: int
    max_rank: int
    experts: bool = False
    stack_parts: int = 0  # the stacked form's parts of s t where the layer has its Bext (lora_in_gemm); 0: none
    stack_shrink: LoraShrink = LoraShrink.AUTO  # how the stacked form makes T (CUPYMOE_LORA_STACK_SHRINK)
    fold: bool = True  # the router delta inside the router and routing launches at the fewest rows (CUPYMOE_LORA_FOLD)
    down_split: LoraDownSplit = LoraDownSplit.COLS  # what lora_down_delta's grid y splits (CUPYMOE_LORA_DOWN_SPLIT)
    overlap: bool = True  # prefill: the router delta and the stacked GEMMs by PDL (CUPYMOE_LORA_OVERLAP; lora_overlap)
    shrink_runs: bool = True  # the chunks' gate/up shrink a run's tiles LORA_SUB rows a block (CUPYMOE_LORA_SHRINK_RUNS)
    swapab: LoraSwapab = LoraSwapab.AUTO  # the decode's gate/up shrinks in the swap-AB gate/up (CUPYMOE_LORA_SWAPAB)


LORA_THREADS = 256  # cuda/lora.cu
LORA_BLOCKS = LORA_TICKETS  # the per-pair kernels' tickets and slice sums bound their splits (workspace.py)
# blocks the slices aim at: two an SM on 132 (measured against 528 and 1056: results/20261202-h200-s6-lora-slices.json)
LORA_SLICE_TARGET = 264
LORA_SLICE_MIN = 128  # input columns a slice takes at least


def lora_slices(items: int, cols: int, row_invariant: bool = False) -> int:
    """Blocks a per-pair LoRA kernel splits each item's (pair's or row's) shrink over `cols`
    input columns into (its grid's y; cuda/lora.cu lora_slice): enough for about
    LORA_SLICE_TARGET blocks, slices of LORA_SLICE_MIN columns at least; 1 from
    LORA_SLICE_TARGET items (so fewer than 2 LORA_BLOCKS slices' sums ever sit in lora_part and
    fewer than LORA_BLOCKS tickets count). A row-invariant layer's are always 1: the slice count
    sets the shrink's summation order, and it would change with N (its prefill plans take the
    per-pair kernels past the grouped kernels' ranks, so a row's bits would depend on how many
    rows came with it)."""
    if items >= LORA_SLICE_TARGET or row_invariant:
        return 1
    return _blocks_an_item(items, cols, LORA_SLICE_MIN)


def lora_down_cols(items: int, cols: int) -> int:
    """Blocks lora_down_delta splits each pair's expand over its `cols` output columns into (by_cols:
    its grid's y; cuda/lora.cu): enough for about LORA_SLICE_TARGET blocks, a column a thread at
    least; no tickets, so no bound but the grid's. Each block does the pair's whole shrink, so a
    pair's bits are the unsplit kernel's at any count (row_invariant holds)."""
    return _blocks_an_item(items, cols, LORA_THREADS)


def _blocks_an_item(items: int, cols: int, cols_a_block: int) -> int:
    """Blocks an item's `cols` split over: about LORA_SLICE_TARGET in all, `cols_a_block` columns each at least."""
    return max(1, min(-(-cols // cols_a_block), -(-LORA_SLICE_TARGET // max(items, 1))))


LORA_GU = "lora_gu"  # the LoRA plans' pre-activation g and u, [P, 2 I_max] bf16 (ACT_PAIR)


def with_lora(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape, *, separated: bool = False,
              given_routing: bool = False, has_shared: Optional[int] = None) -> ForwardPlan:
    """`plan` with the router's LoRA delta launched right after the router (its logits' copy 0,
    before the routing stage reads them): a block a row, or where the deltas go grouped
    (lora_grouped) a block lora_router_span rows bucketed by adapter (_router_delta); at the decode
    chain's fewest rows folded into the router and routing launches instead (lora_fold). Each LoRA launch goes as the
    launch it precedes does (_as_successor): by PDL inside the decode chain, plainly elsewhere.
    With `lora.experts`, the expert deltas too (_with_expert_deltas). On the prefill path with
    lora_overlap, the router delta and each stacked GEMM go by PDL after the launch before them.
    `given_routing` (the experts-only entry's plan): no router delta; experts_route_in becomes
    experts_route_in_lora, which flags an id past the slots as the router's delta does. `has_shared`:
    whether `plan` runs the shared expert (default the layer's; 0 where the call leaves it out)."""
    sh = lp.has_shared if has_shared is None else has_shared
    steps = list(plan.steps)
    overlap = lora_overlap(plan, lp, lora, separated)
    if given_routing:
        steps = [_route_in_lora(s, lora) if getattr(s, "kernel", "") == "experts_route_in" else s for s in steps]
        if lora.experts:
            steps = _with_expert_deltas(steps, plan, lp, lora, overlap, sh)
        return replace(plan, steps=tuple(steps))
    at = _past_router(steps)
    if lora_fold(plan, lp, lora):
        steps[at - 1], steps[at] = _router_lora(steps[at - 1], lp, lora), _route_lists_lora(steps[at], lp, lora)
    elif lora_router_t(plan, lp, lora):
        steps[at - 1], steps[at] = _router_t(steps[at - 1], lora), _topk_route_lora(steps[at], lp, lora)
    else:
        delta = _as_successor(_router_delta(plan, lp, lora), steps[at])
        steps.insert(at, replace(delta, pdl=True) if overlap and isinstance(steps[at - 1], Launch) else delta)
    if lora.experts:
        steps = _with_expert_deltas(steps, plan, lp, lora, overlap, sh)
    return replace(plan, steps=tuple(steps))


def _route_in_lora(step: Launch, lora: LoraShape) -> Launch:
    """experts_route_in as experts_route_in_lora: its arguments, then the rows' slots and their count."""
    return replace(step, kernel="experts_route_in_lora",
                   args=step.args + (u64("lora_ids", CallValue.LORA_IDS), i32("max_loras", lora.max_loras)))


def lora_overlap(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape, separated: bool) -> bool:
    """Whether the prefill plan's LoRA launches overlap the launches before them by PDL (lora.overlap,
    CUPYMOE_LORA_OVERLAP): the router delta the router (cuda/lora.cu: its bucketing and shrinks read
    the call's x and ids alone, the logits after its wait), each stacked GEMM its shrink (cuda:
    grouped_sm90_tma.cu, grouped.cu: T read after the wait, before the extra K). Where PDL runs
    (sm_90, CUPYMOE_PDL) and no stage event or profile sync stands between the launches."""
    return lora.overlap and lp.pdl and plan.path == Path.PREFILL and not separated


def lora_router_t_rows(lp: LayerPlan, knob: Optional[int], max_loras: int, max_rank: int) -> int:
    """Prefill rows up to which a layer with adapter slots (max_loras of max_rank) makes the router's
    LoRA t in the router GEMM (lora_router_t): the knob's (CUPYMOE_LORA_ROUTER_T_ROWS) or
    heuristics.LORA_ROUTER_T_ROWS; 0 where the slots' t columns pass C.LORA_ROUTER_T_MAX_COLS, and
    for a row-invariant layer (a row's router delta would sum in another order past those rows)."""
    if C.lora_router_t_cols(max_loras, max_rank) > C.LORA_ROUTER_T_MAX_COLS or lp.row_invariant:
        return 0
    return HX.LORA_ROUTER_T_ROWS if knob is None else knob


def lora_router_t(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape) -> bool:
    """Whether the prefill plan makes the router's LoRA shrink in the router's own grid and its
    expand in top-k (_router_t, _topk_route_lora) instead of lora_grouped_router_delta: rows up to
    lp.lora_router_t_rows (PrefillShape.lora_router_t), where the router is grouped.cu's GEMM
    (not the wgmma one) and top-k is topk_route. One link fewer: t's columns are a few more tiles
    of a grid the router leaves mostly idle."""
    if plan.path != Path.PREFILL or plan.shape is None or not plan.shape.lora_router_t:
        return False
    at = _past_router(plan.steps)
    router, route = plan.steps[at - 1], plan.steps[at]
    return (getattr(router, "kernel", "").startswith(f"grouped_gemm<{int(GemmMode.ROUTER)}, ")
            and getattr(route, "kernel", "").startswith("topk_route<")
            and C.lora_router_t_cols(lora.max_loras, lora.max_rank) <= C.LORA_ROUTER_T_MAX_COLS)


def _router_t(router: Launch, lora: LoraShape) -> Launch:
    """The router GEMM with the slots' A rows (three bf16 parts, lora_slots.py) as more column tiles,
    their products into lora_router_t (cuda/grouped.cu router_t_tile)."""
    cols = C.lora_router_t_cols(lora.max_loras, lora.max_rank)
    extra = (u64("lora_t", S("lora_router_t")), u64("lora_b0", Buf(Space.LAYER, "lora_router_a3")),
             u64("lora_b1", 0), i32("KS", cols))
    grid = (router.grid[0] + -(-cols // C.GROUPED_BN),) + tuple(router.grid[1:])
    return replace(router, kernel=C.lora_grouped_kernel(router.kernel), grid=grid, args=router.args + extra)


def _topk_route_lora(route: Launch, lp: LayerPlan, lora: LoraShape) -> Launch:
    """topk_route adding the router's delta from lora_router_t first (cuda/topk.cu topk_route_lora):
    its arguments, then the row ids, t, the slots' s B and their shape."""
    extra = (u64("lora_ids", CallValue.LORA_IDS), u64("lora_t", S("lora_router_t")),
             u64("bs", Buf(Space.LAYER, "lora_router_bs")), i32("max_rank", lora.max_rank),
             i32("max_loras", lora.max_loras))
    return replace(route, kernel=route.kernel.replace("topk_route<", "topk_route_lora<"), args=route.args + extra,
                   smem=C.topk_route_lora_smem_bytes(lp.cfg.router_width, lora.max_rank))


def _past_router(steps) -> int:
    """The index of the first launch past the router's."""
    return next(i for i, s in enumerate(steps) if s.stage != Stage.ROUTER)


def _router_delta(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape) -> Launch:
    """The router's delta as a launch of its own: lora_router_delta (a block a row, its H split over
    lora_slices blocks), or lora_grouped_router_delta where the deltas go grouped."""
    cfg = lp.cfg
    rows = _rows(plan)
    args = (u64("x", X), u64("lora_ids", CallValue.LORA_IDS), u64("a", Buf(Space.LAYER, "lora_router_a")),
            u64("bs", Buf(Space.LAYER, "lora_router_bs")), u64("logits", S("logits")))
    slice_args = (u64("part", S("lora_part")), u64("tickets", S("lora_tickets")))
    sizes = (u64("err", ERR), i32("N", rows), i32("H", cfg.hidden_size), i32("R", cfg.router_width), i32("max_rank", lora.max_rank),
            i32("max_loras", lora.max_loras))
    if lora_grouped(plan, lp, lora):
        Y = lora_chunk_blocks(lora.max_loras)
        span = PerN("lora_router_span", lambda n: lora_router_span(n, Y))
        spans = PerN("lora_router_spans", lambda n: -(-n // lora_router_span(n, Y)))
        return Launch(Stage.ROUTER, "lora_grouped_router_delta", (spans, Y), (LORA_MMA_WARPS * 32,),
                      args + sizes + (i32("span", span),), lora_grouped_smem(lora.max_rank, False))
    H, ri = cfg.hidden_size, lp.row_invariant
    slices = (lora_slices(rows, H, ri) if isinstance(rows, int)
              else PerN("lora_router_slices", lambda n: lora_slices(n, H, ri)))
    return Launch(Stage.ROUTER, "lora_router_delta", (rows, slices), (LORA_THREADS,), args + slice_args + sizes,
                  C.lora_pair_smem_bytes(lora.max_rank))


def lora_fold(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape) -> bool:
    """Whether the plan folds the router's LoRA delta into the router and routing launches
    (router_logits_bf16_lora: lora_fold_slices blocks more in the router's grid, each a slice of
    the shrink and its share of the expand; decode_route_lists_lora: the shares added to the logits
    it routes): the decode path up to heuristics.LORA_FOLD_ROWS rows, where lora_router_delta's
    launch is a link of the chain whose shrink, meeting and expand run one after another."""
    if not (lora.fold and plan.path == Path.DECODE and plan.shape is None and plan.built_for <= HX.LORA_FOLD_ROWS):
        return False
    at = _past_router(plan.steps)
    router, route = plan.steps[at - 1], plan.steps[at]
    n, cfg = plan.built_for, lp.cfg
    shares = n * lora_fold_slices(n, lp) * cfg.router_width
    return (getattr(router, "kernel", "").startswith("router_logits_bf16<1, ")
            and getattr(route, "kernel", "") == "decode_route_lists"
            and C.route_lists_lora_smem_bytes(n, cfg.num_experts_per_tok, cfg.router_width) <= C.STATIC_SMEM_LIMIT
            and shares <= lora_part_floats(lora.max_rank))


LORA_FOLD_SLICES = 16  # cuda/lora_common.cuh: the folded router delta's slices at most


def lora_fold_slices(n: int, lp: LayerPlan) -> int:
    """The folded router delta's slices of H: lora_router_delta's, at most LORA_FOLD_SLICES (each
    a share decode_route_lists_lora loads at once)."""
    return min(lora_slices(n, lp.cfg.hidden_size, lp.row_invariant), LORA_FOLD_SLICES)


def _router_lora(router: Launch, lp: LayerPlan, lora: LoraShape) -> Launch:
    """router_logits_bf16 with the router's LoRA delta as lora_fold_slices more blocks of its grid
    (cuda/router.cu router_logits_bf16_lora): its arguments, then the row ids, the router slots' A
    and scale * B, lora_part (the delta's shares), the error word and the sizes."""
    n = router.arg("N")
    extra = (u64("lora_ids", CallValue.LORA_IDS), u64("lora_a", Buf(Space.LAYER, "lora_router_a")),
             u64("lora_bs", Buf(Space.LAYER, "lora_router_bs")), u64("part", S("lora_part")), u64("err", ERR),
             i32("max_rank", lora.max_rank), i32("max_loras", lora.max_loras))
    grid = (router.grid[0] + lora_fold_slices(n, lp),) + tuple(router.grid[1:])
    return replace(router, kernel=router.kernel.replace("router_logits_bf16<", "router_logits_bf16_lora<"),
                   grid=grid, args=router.args + extra, smem=lora.max_rank * 4)


def _route_lists_lora(route: Launch, lp: LayerPlan, lora: LoraShape) -> Launch:
    """decode_route_lists adding the delta's shares router_logits_bf16_lora left in lora_part to the
    logits it routes (cuda/decode.cu decode_route_lists_lora): its arguments, then the row ids,
    lora_part, the shares' count and the slots' count."""
    cfg, n = lp.cfg, route.arg("N")
    extra = (u64("lora_ids", CallValue.LORA_IDS), u64("part", S("lora_part")), i32("S", lora_fold_slices(n, lp)),
             i32("max_loras", lora.max_loras))
    smem = C.route_lists_lora_smem_bytes(n, cfg.num_experts_per_tok, cfg.router_width)
    return replace(route, kernel="decode_route_lists_lora", args=route.args + extra, smem=smem)


LORA_MMA_WARPS = 8  # cuda/lora.cu LORA_MMA_WARPS: the grouped deltas' blocks
LORA_CHUNK = 32  # cuda/lora.cu LORA_CHUNK: rows of one adapter the grouped deltas take at once
LORA_ROUTER_ROWS = 32  # rows a block of lora_grouped_router_delta at least (one chunk's)
LORA_SUB = 192  # cuda/lora.cu LORA_SUB: positions a block buckets at once (a router span at most)
LORA_ROUTER_WAVE = 2 * 132  # lora_grouped_router_delta's blocks resident at once on 132 SMs (2 an SM)
LORA_GROUPED_SMEM_MAX = 80 * 1024  # under every sm_80+ opt-in maximum (jit.opt_in_smem opts them in)
LORA_DOWN_SLICE = 512  # output columns a lora_grouped_down_delta block expands at least
LORA_DOWN_SLICES_MAX = 4  # its column slices (grid z) at most: each recomputes the chunk's shrink


def lora_chunk_blocks(max_loras: int) -> int:
    """Blocks the grouped deltas give each tile (router: each row span), grid y: block y takes
    the tile's chunks y, y + Y, ... (cuda/lora.cu), so a tile's adapters' chunks (one or more
    each) run side by side instead of one after another in one block; 4 (8 past 4 adapters).
    A chunk's work is the same whichever block does it: a row's bits do not depend on Y."""
    return 4 if max_loras <= 4 else 8


def lora_router_span(n: int, blocks_per_span: int) -> int:
    """Rows a block of lora_grouped_router_delta buckets: LORA_ROUTER_ROWS, or more (a multiple of
    16, LORA_SUB at most) where that many would take more than LORA_ROUTER_WAVE blocks, so its
    grid stays one wave while it can (each block's trips are mostly its own latency; a second
    round doubles them). A row's bits do not depend on its span."""
    return next((r for r in range(LORA_ROUTER_ROWS, LORA_SUB, 16) if -(-n // r) * blocks_per_span <= LORA_ROUTER_WAVE),
                LORA_SUB)


def lora_down_slices(hidden: int) -> int:
    """lora_grouped_down_delta's column slices of H (grid z; cuda/lora.cu lora_slice): a slice
    LORA_DOWN_SLICE columns at least, LORA_DOWN_SLICES_MAX at most (each slice's block recomputes
    the chunk's shrink, A_down [max_rank, I] and the chunk's act rows, from L2)."""
    return max(1, min(LORA_DOWN_SLICES_MAX, hidden // LORA_DOWN_SLICE))


def lora_grouped_smem(max_rank: int, gate_up: bool) -> int:
    """The grouped deltas' dynamic shared memory: each warp's partial t and the summed t,
    [LORA_CHUNK][rp] floats a projection (rp = max_rank rounded up to 16; gate/up's staging
    reuses the parts; the router's and down's: one projection)."""
    rp = -(-max_rank // 16) * 16
    return (LORA_MMA_WARPS + 1) * (2 if gate_up else 1) * LORA_CHUNK * rp * 4


LORA_STACK_MAX_WIDTH = 128  # KS past which the grouped deltas serve: every row pays the extra K (measured at 64)


def lora_grouped_rank_ok(max_rank: int) -> bool:
    """Whether the grouped delta kernels (and so the stacked form) serve this rank: its shared
    memory within LORA_GROUPED_SMEM_MAX (the per-pair kernels serve any rank)."""
    return lora_grouped_smem(max_rank, True) <= LORA_GROUPED_SMEM_MAX


def lora_stack_parts(lp: LayerPlan, knob_parts: int, max_loras: int, max_rank: int) -> int:
    """The stacked form's parts a layer holds Bext and T for (0: none): CUPYMOE_LORA_IN_GEMM's,
    where a GEMM can run it (stacked_gemms: not row-invariant, a rank the grouped kernels serve)
    and its K steps stay within LORA_STACK_MAX_WIDTH columns."""
    from .lora_stack import stack_width

    if not knob_parts or not stacked_gemms(lp) or lp.row_invariant or not lora_grouped_rank_ok(max_rank):
        return 0
    return knob_parts if stack_width(max_loras, max_rank, knob_parts) <= LORA_STACK_MAX_WIDTH else 0


def stacked_gemms(lp: LayerPlan) -> bool:
    """Whether the layer's prefill GEMMs have a stacked form: the bf16 TMA kernels (a TMA layer), or
    grouped.cu's on fp8 experts with bf16 activations (w8a16: grouped_gemm_lora)."""
    return lp.tma or (not lp.w8a8 and bool(lp.formats) and all(f in C.LORA_GROUPED_FORMATS for f in lp.formats))


def lora_grouped(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape) -> bool:
    """Whether the expert deltas go grouped (a block a GEMM tile, on tensor cores): on the prefill
    path past the one-block sort's pairs (fewer rows leave a tile a chunk or two, which the
    per-pair kernels' 256 threads a pair finish sooner), and at every prefill N of a row-invariant
    layer (whose rows' kernels must not change with N); never where the rank's shared memory
    passes LORA_GROUPED_SMEM_MAX (the per-pair kernels serve any rank). A bucket plan's shape
    fixes the choice, so every N of a bucket runs the same kernels."""
    if plan.path != Path.PREFILL or not lora_grouped_rank_ok(lora.max_rank):
        return False
    return lp.row_invariant or not plan.shape.one_block_sort


@dataclass(frozen=True)
class TileList:
    """A grouped GEMM launch's tile list: its num_tiles and tile_info arguments and its grid's
    tile bound (a PerN in a bucket plan)."""

    num_tiles: Arg
    tile_info: Arg
    bound: object


def _tile_list(steps: list, stage: Stage) -> TileList:
    """The tile list of the stage's last grouped GEMM (the one in scratch when the stage ends)."""
    gemm = [s for s in steps if isinstance(s, Launch) and s.stage == stage
            and {a.name for a in s.args} >= {"act_code", "tile_info"}][-1]
    return TileList(u64("num_tiles", gemm.arg("num_tiles")), u64("tile_info", gemm.arg("tile_info")), gemm.grid[1])


def _as_successor(launch: Launch, successor) -> Launch:
    """`launch`, inserted before `successor`, with its PDL flag: inside a PDL chain the new kernel
    releases its successor only after its own wait and reads before that wait only what the
    launches before its predecessor wrote (cuda/lora.cu "Early start"), so the chain stays
    transitively ordered; before a plain launch (prefill, separated plans) it goes plainly too."""
    return replace(launch, pdl=bool(getattr(successor, "pdl", False)))


def _with_expert_deltas(steps: list, plan: ForwardPlan, lp: LayerPlan, lora: LoraShape, overlap: bool,
                        has_shared: int) -> list:
    """The experts' deltas: each gate/up GEMM launched once with ACT_PAIR (g and u into lora_gu:
    the fused activation leaves no hook), then lora_gate_up_act (the gate / up deltas and the
    activation into act), and lora_down_delta after the down GEMMs, before the reduce (on the
    prefill path past the one-block sort, their grouped forms). The new launches take their
    successors' PDL flags (_as_successor); the rest keep theirs, but a stacked GEMM goes by PDL after
    its shrink where the plan overlaps (lora_overlap)."""
    if lp.w8a8:  # the w8a8 gate/up quantizes the activation in its epilogue, before any delta
        raise LoraError("LoRA on the experts with fp8_compute='w8a8' is not implemented; build the layer with "
                        "fp8_compute='w8a16' or use router-only adapters")
    stacked = {stage: lora_in_gemm(plan, lp, lora, steps, stage) for stage in (Stage.GATE_UP, Stage.DOWN)}
    swapab = lora_swapab(plan, lp, lora, steps)
    out: list = []
    for s in steps:
        if _is_gemm(s, Stage.GATE_UP) and not stacked[Stage.GATE_UP]:
            out.append(_pair(_swapab_lora(s, lp, lora) if swapab else s))
        elif _is_gemm(s, Stage.GATE_UP) or _is_gemm(s, Stage.DOWN):
            out.extend(_stacked_gemm(s, lp, lora, _shrink_form(plan, lora, s.stage), overlap, _rows(plan))
                       if stacked[s.stage] else (s,))
        else:
            out.append(s)
    if lora_grouped(plan, lp, lora):
        gate_up_act, down = _grouped_delta_launches(_tile_list(out, Stage.GATE_UP), _tile_list(out, Stage.DOWN), lp,
                                                    lora)
    else:
        gate_up_act, down = _expert_delta_launches(plan, lp, lora, has_shared, swapab)
    if not stacked[Stage.GATE_UP]:
        at = max(i for i, s in enumerate(out) if s.stage == Stage.GATE_UP) + 1
        out.insert(at, _as_successor(gate_up_act, out[at]))
    if not stacked[Stage.DOWN]:
        at = next(i for i, s in enumerate(out) if s.stage == Stage.REDUCE)
        out.insert(at, _as_successor(down, out[at]))
    return out


SWAPAB_GATE_UP = "decode_swapab_gate_up<"


def lora_swapab(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape, steps) -> bool:
    """Whether the decode's gate/up deltas go in the swap-AB form (lora.swapab: CUPYMOE_LORA_SWAPAB; auto:
    heuristics.lora_swapab_rows): the plan's one gate/up launch is the bf16 swap-AB kernel and the
    slots' rank has its form (catalog.swapab_lora_rank); its shrinks then run as more blocks of that
    launch (decode_swapab_gate_up_lora) and lora_gate_up_expand_act adds the expands, instead of
    lora_gate_up_act's per-pair shrinks after it."""
    if not (lora.experts and lora.swapab != LoraSwapab.OFF and C.swapab_lora_rank(lora.max_rank)):
        return False
    if lora.swapab == LoraSwapab.AUTO and not HX.lora_swapab_rows(lp, plan.built_for, lora.max_loras):
        return False
    gemms = [s for s in steps if _is_gemm(s, Stage.GATE_UP)]
    return len(gemms) == 1 and gemms[0].kernel.startswith(SWAPAB_GATE_UP)


def _swapab_lora(gemm: Launch, lp: LayerPlan, lora: LoraShape) -> Launch:
    """The swap-AB gate/up as decode_swapab_gate_up_lora: its column blocks, then
    catalog.swapab_lora_blocks LoRA blocks an expert writing s t into lora_pair_t."""
    x0 = gemm.grid[0]
    extra = (u64("lora_ids", CallValue.LORA_IDS), u64("lora_scale", Buf(Space.LAYER, "lora_scale")),
             u64("lora_t", S("lora_pair_t")), i32("lora_x0", x0), i32("n_local", lp.n_local),
             i32("max_rank", lora.max_rank), i32("max_loras", lora.max_loras))
    return replace(gemm, kernel=gemm.kernel.replace(SWAPAB_GATE_UP, "decode_swapab_gate_up_lora<"),
                   grid=(x0 + C.swapab_lora_blocks(lora.max_loras, lora.max_rank),) + tuple(gemm.grid[1:]),
                   args=gemm.args + extra)


def _is_gemm(step, stage: Stage) -> bool:
    """Whether `step` is a grouped or decode GEMM of `stage` (gate/up or down: they take act_code)."""
    return isinstance(step, Launch) and step.stage == stage and any(a.name == "act_code" for a in step.args)


TMA_GEMM = "grouped_gemm_sm90_tma<"


def lora_in_gemm(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape, steps, stage: Stage) -> bool:
    """Whether `stage`'s expert deltas go in the stacked form (cupymoe/lora_stack.py: extra K of the
    GEMM, T from lora_stack_t_*): where the layer holds Bext (lora.stack_parts: CUPYMOE_LORA_IN_GEMM,
    stacked_gemms, not row-invariant), the grouped deltas would serve (lora_grouped: past the
    one-block sort; a bucket plan's shape fixes it) and the stage's one GEMM launch has a stacked
    twin: the bf16 TMA kernel (grouped_gemm_sm90_tma: every variant, gathering or 192-row too) or
    grouped.cu's on fp8 weights (w8a16). Else today's delta kernels."""
    if not (lora.experts and lora.stack_parts and not lp.row_invariant and lora_grouped(plan, lp, lora)):
        return False
    gemms = [s for s in steps if _is_gemm(s, stage)]
    return len(gemms) == 1 and (gemms[0].kernel.startswith(TMA_GEMM) or _grouped_lora_twin(gemms[0].kernel))


def _grouped_lora_twin(kernel: str) -> bool:
    """Whether `kernel` is a grouped.cu GEMM whose stacked form is built (grouped_gemm_lora: gate/up or
    down on C.LORA_GROUPED_FORMATS' weights)."""
    if not kernel.startswith("grouped_gemm<"):
        return False
    mode, *_, fmt = (int(a) for a in kernel[len("grouped_gemm<"):-1].split(","))
    return mode in (GemmMode.GATE_UP, GemmMode.DOWN) and WeightFormat(fmt) in C.LORA_GROUPED_FORMATS


def lora_kernel_name(kernel: str) -> str:
    """grouped_gemm_sm90_tma<...> as its stacked form grouped_gemm_sm90_tma_lora<...>, every template
    argument spelled (gather 0 and 2 warpgroups where the base name leaves them to their defaults)."""
    args = [a.strip() for a in kernel[len(TMA_GEMM):-1].split(",")]
    args += ["0", "2"][len(args) - 4:]
    return f"grouped_gemm_sm90_tma_lora<{', '.join(args)}>"


def _shrink_form(plan: ForwardPlan, lora: LoraShape, stage: Stage) -> LoraShrink:
    """How the stacked form's shrink of `stage` (gate/up or down) makes T: the knob's form, or where it
    is auto the prefill shape's."""
    if lora.stack_shrink != LoraShrink.AUTO:
        return lora.stack_shrink
    shape = plan.shape
    if shape is None:
        return LoraShrink.CHUNKS
    return shape.lora_down_shrink if stage == Stage.DOWN else shape.lora_gate_up_shrink


def _stacked_gemm(gemm: Launch, lp: LayerPlan, lora: LoraShape, form: LoraShrink, overlap: bool,
                  rows) -> tuple[Launch, Launch]:
    """A GEMM in the stacked form: its shrink (T of the GEMM's tiles, lora_stack_t_*, lora_chunk_blocks
    blocks a tile) and the GEMM as its twin: grouped_gemm_sm90_tma_lora (lora_steps past its
    arguments) or grouped_gemm_lora (T, gate's or down's Bext, up's, KS past them); `form`: the shrink's
    (chunks, segments or expert pieces), `rows`: the call's N (_rows); with `overlap` the twin by PDL
    (it reads T only after its wait, before the extra K)."""
    from .lora_stack import lora_steps, stack_width

    cfg = lp.cfg
    L = lambda name: u64(name, Buf(Space.LAYER, "lora_" + name))  # noqa: E731  (lora_slots.LoraSlots.ptr)
    tiles = (gemm.arg("num_tiles"), gemm.arg("tile_info"))
    tail = (i32("n_local", lp.n_local), i32("max_rank", lora.max_rank), i32("max_loras", lora.max_loras),
            i32("parts", lora.stack_parts), i32("KS", stack_width(lora.max_loras, lora.max_rank, lora.stack_parts)))
    grid = (gemm.grid[1], lora_chunk_blocks(lora.max_loras))  # the chunks form's
    if form != LoraShrink.CHUNKS:
        shrink = _shrink_segments(gemm, lp, lora, L, tiles, tail, rows, form)
    elif gemm.stage == Stage.GATE_UP:
        # with shrink_runs a run's tiles go LORA_SUB rows a block (cuda/lora.cu lora_run_piece): grouped.cu's
        # tiles (64 rows, w8a16), not the TMA GEMM's 128 / 192, where a block would take its tile alone
        by_runs = lora.shrink_runs and not gemm.kernel.startswith(TMA_GEMM)
        shrink = Launch(Stage.GATE_UP, "lora_stack_t_gate_up_runs" if by_runs else "lora_stack_t_gate_up",
                        grid, (LORA_MMA_WARPS * 32,),
                        (u64("x", X), u64("xe", S("xe") if cfg.pre_expert_norm else X),
                         u64("lora_ids", CallValue.LORA_IDS), u64("num_tiles", tiles[0]), u64("tile_info", tiles[1]),
                         u64("sorted_row", S("sorted_row")), L("gate_a"), L("up_a"), L("scale"),
                         u64("T", S("lora_t_gu")), i32("H", cfg.hidden_size), *tail)
                        + (tuple(u64(name, S(name)) for name in ("num_active", "active_start", "active_len"))
                           if by_runs else ()),
                        lora_grouped_smem(lora.max_rank, True))
    else:
        shrink = Launch(Stage.DOWN, "lora_stack_t_down", grid, (LORA_MMA_WARPS * 32,),
                        (u64("act", S("act")), u64("lora_ids", CallValue.LORA_IDS), u64("num_tiles", tiles[0]),
                         u64("tile_info", tiles[1]), u64("sorted_row", S("sorted_row")), u64("inter", W("inter")),
                         L("down_a"), L("scale"), u64("T", S("lora_t_down")), i32("I_max", lp.i_max), *tail),
                        lora_grouped_smem(lora.max_rank, False))
    if gemm.kernel.startswith(TMA_GEMM):  # T and Bext by its tensor maps
        steps = lora_steps(lora.max_loras, lora.max_rank, lora.stack_parts)
        stacked = replace(gemm, kernel=lora_kernel_name(gemm.kernel), args=gemm.args + (i32("lora_steps", steps),))
    else:  # grouped_gemm_lora: T and Bext by address
        gate_up = gemm.stage == Stage.GATE_UP
        b0, b1 = ("gate_bx", "up_bx") if gate_up else ("down_bx", "down_bx")
        stacked = replace(gemm, kernel=C.lora_grouped_kernel(gemm.kernel),
                          args=gemm.args + (u64("lora_t", S("lora_t_gu" if gate_up else "lora_t_down")),
                                            u64("lora_b0", Buf(Space.LAYER, "lora_" + b0)),
                                            u64("lora_b1", Buf(Space.LAYER, "lora_" + b1)),
                                            i32("KS", stack_width(lora.max_loras, lora.max_rank, lora.stack_parts))))
    return _as_successor(shrink, gemm), replace(stacked, pdl=True) if overlap else stacked


def _shrink_segments(gemm: Launch, lp: LayerPlan, lora: LoraShape, L, tiles, tail, rows,
                     form: LoraShrink) -> Launch:
    """The stacked form's shrink as lora_stack_t_seg<NP, BN>: grid (the GEMM's tile bound, max_loras),
    block (t, a) taking tile t's rows of adapter a against a's NP R A rows (BN: catalog.lora_seg_bn);
    `form` EXPERTS: lora_stack_t_seg_experts, a block (expert piece, adapter)."""
    cfg = lp.cfg
    gate_up = gemm.stage == Stage.GATE_UP
    np_ = 2 if gate_up else 1
    bn = C.lora_seg_bn(np_, lora.max_rank)
    inputs = ((u64("x", X), u64("xe", S("xe") if cfg.pre_expert_norm else X), u64("act", 0)) if gate_up
              else (u64("x", 0), u64("xe", 0), u64("act", S("act"))))
    a = ((u64("a0", Buf(Space.LAYER, "lora_gate_a")), u64("a1", Buf(Space.LAYER, "lora_up_a"))) if gate_up
         else (u64("a0", Buf(Space.LAYER, "lora_down_a")), u64("a1", 0)))
    if form == LoraShrink.EXPERTS:
        name, grid = f"lora_stack_t_seg_experts<{np_}, {bn}>", _expert_pieces_grid(rows, lp, lora)
        runs = (u64("num_active", S("num_active")),
                *(u64(b, S(b)) for b in ("active_slot", "active_start", "active_len")))
    else:
        name, grid = f"lora_stack_t_seg<{np_}, {bn}>", (gemm.grid[1], lora.max_loras)
        runs = (u64("num_tiles", tiles[0]), u64("tile_info", tiles[1]))
    return Launch(gemm.stage, name, grid, (C.LORA_SEG_THREADS,),
                  inputs + (u64("lora_ids", CallValue.LORA_IDS), *runs,
                            u64("sorted_row", S("sorted_row")), u64("inter", W("inter")), *a, L("scale"),
                            u64("T", S("lora_t_gu" if gate_up else "lora_t_down")), i32("H", cfg.hidden_size),
                            i32("I_max", lp.i_max), *tail),
                  C.lora_seg_smem(bn))


def _rows(plan: ForwardPlan):
    """The call's row count N: the plan's own in an exact plan, a PerN in a bucket plan."""
    return plan.built_for if plan.shape is None else PerN("N", lambda n: n)


def _expert_pieces_grid(rows, lp: LayerPlan, lora: LoraShape) -> tuple:
    """lora_stack_t_seg_experts' grid: (the active experts' bound, max_loras, ceil(N / LSS_PIECE))."""
    k, sh = lp.cfg.num_experts_per_tok, int(lp.has_shared)
    active = lambda n: max(1, min(lp.n_local, n * k) + sh)  # noqa: E731
    pieces = lambda n: -(-n // C.LORA_SEG_PIECE_ROWS)  # noqa: E731
    if isinstance(rows, PerN):
        return PerN("lora_active", active), lora.max_loras, PerN("lora_pieces", pieces)
    return active(rows), lora.max_loras, pieces(rows)


def _pair(launch: Launch) -> Launch:
    """`launch` (a gate/up GEMM) storing g and u into lora_gu instead of act(g, u) into act (the
    output argument is "act" on decode, "out" on the grouped GEMMs)."""
    def arg(a: Arg) -> Arg:
        if a.name == "act_code":
            return replace(a, value=int(Activation.PAIR))
        if a.name in ("act", "out"):
            return replace(a, value=S(LORA_GU))
        return a
    return replace(launch, args=tuple(arg(a) for a in launch.args))


def _expert_delta_launches(plan: ForwardPlan, lp: LayerPlan, lora: LoraShape,
                           has_shared: int, swapab: bool = False) -> tuple[Launch, Launch]:
    """The per-pair deltas' launches: a block (row of blocks) a routed pair, then (has_shared, where the
    plan runs the shared expert) one a row for the shared expert's pair. `swapab` (lora_swapab): gate/up's
    is lora_gate_up_expand_act, the expands alone, the swap-AB gate/up having made s t."""
    cfg = lp.cfg
    k, sh, H = cfg.num_experts_per_tok, has_shared, cfg.hidden_size
    exact = plan.shape is None
    rows = plan.built_for if exact else PerN("N", lambda n: n)
    pairs = plan.built_for * (k + sh) if exact else PerN("lora_pairs", lambda n: n * (k + sh))
    I_max = lp.i_max
    ri = lp.row_invariant
    by_cols = lora.down_split == LoraDownSplit.COLS
    down_split = (lambda n: lora_down_cols(n, H)) if by_cols else (lambda n: lora_slices(n, I_max, ri))
    if exact:
        gate_up_slices, down_slices = lora_slices(pairs, H, ri), down_split(pairs)
    else:
        gate_up_slices = PerN("lora_gate_up_slices", lambda n: lora_slices(n * (k + sh), H, ri))
        down_slices = PerN("lora_down_slices", lambda n: down_split(n * (k + sh)))
    slice_args = (u64("part", S("lora_part")), u64("tickets", S("lora_tickets")))
    where = (u64("lora_ids", CallValue.LORA_IDS), u64("ids", S("topk_ids")), u64("pair_pos", S("pair_pos")),
             u64("slot_of", W("slot_of")), u64("inter", W("inter")))
    sizes = (i32("N", rows), i32("k", k), i32("H", H), i32("I_max", lp.i_max), i32("n_local", lp.n_local),
             i32("max_rank", lora.max_rank), i32("max_loras", lora.max_loras))
    L = lambda name: u64(name, Buf(Space.LAYER, "lora_" + name))  # noqa: E731  (lora_slots.LoraSlots.ptr)
    activation = (i32("act_code", Activation[cfg.hidden_act.upper()]), f32("alpha", cfg.swiglu_alpha),
                  f32("limit", cfg.swiglu_limit))
    gu_act = (u64("gu", S(LORA_GU)), u64("act", S("act")))
    if swapab:
        gate_up = Launch(Stage.GATE_UP, "lora_gate_up_expand_act", (pairs,), (LORA_THREADS,),
                         (u64("lora_t", S("lora_pair_t")), *where, L("gate_b"), L("up_b"), *gu_act,
                          *(a for a in sizes if a.name != "H"), *activation), C.lora_pair_smem_bytes(lora.max_rank, 2))
    else:
        gate_up = Launch(Stage.GATE_UP, "lora_gate_up_act", (pairs, gate_up_slices), (LORA_THREADS,),
                         (u64("x", X), u64("xe", S("xe") if cfg.pre_expert_norm else X), *where,
                          *(L(f"{p}_{m}") for p in ("gate", "up") for m in "ab"), L("scale"), *gu_act, *slice_args,
                          *sizes, *activation), C.lora_pair_smem_bytes(lora.max_rank, 2))
    mode = {Path.DECODE: LoraDownMode.DECODE, Path.ATOMIC: LoraDownMode.ATOMIC,
            Path.PREFILL: LoraDownMode.GROUPED}[plan.path]
    down = Launch(Stage.DOWN, "lora_down_delta", (pairs, down_slices), (LORA_THREADS,),
                  (u64("act", S("act")), *where, L("down_a"), L("down_b"), L("scale"), u64("topk_w", S("topk_w")),
                   u64("y", S("y")), u64("acc", S("acc")), u64("yw", S("yw")), *slice_args, *sizes,
                   i32("mode", int(mode)), i32("by_cols", int(by_cols))),
                  C.lora_pair_smem_bytes(lora.max_rank))
    return gate_up, down


def _grouped_delta_launches(gate_up_tiles: TileList, down_tiles: TileList, lp: LayerPlan,
                            lora: LoraShape) -> tuple[Launch, Launch]:
    """The prefill path's deltas, lora_chunk_blocks blocks a tile of the GEMM before them
    (cuda/lora.cu, lora_grouped_*; down's also over lora_down_slices column slices): the same
    slots, inputs and outputs as lora_gate_up_act / lora_down_delta in GROUPED mode."""
    cfg = lp.cfg
    L = lambda name: u64(name, Buf(Space.LAYER, "lora_" + name))  # noqa: E731  (lora_slots.LoraSlots.ptr)
    sizes = (i32("H", cfg.hidden_size), i32("I_max", lp.i_max), i32("n_local", lp.n_local),
             i32("max_rank", lora.max_rank), i32("max_loras", lora.max_loras))
    Y = lora_chunk_blocks(lora.max_loras)
    gate_up = Launch(Stage.GATE_UP, "lora_grouped_gate_up_act", (gate_up_tiles.bound, Y), (LORA_MMA_WARPS * 32,),
                     (u64("x", X), u64("xe", S("xe") if cfg.pre_expert_norm else X),
                      u64("lora_ids", CallValue.LORA_IDS), gate_up_tiles.num_tiles, gate_up_tiles.tile_info,
                      u64("sorted_row", S("sorted_row")), u64("inter", W("inter")),
                      *(L(f"{p}_{m}") for p in ("gate", "up") for m in "ab"), L("scale"),
                      u64("gu", S(LORA_GU)), u64("act", S("act")), *sizes,
                      i32("act_code", Activation[cfg.hidden_act.upper()]), f32("alpha", cfg.swiglu_alpha),
                      f32("limit", cfg.swiglu_limit)), lora_grouped_smem(lora.max_rank, True))
    down = Launch(Stage.DOWN, "lora_grouped_down_delta", (down_tiles.bound, Y, lora_down_slices(cfg.hidden_size)),
                  (LORA_MMA_WARPS * 32,),
                  (u64("act", S("act")), u64("lora_ids", CallValue.LORA_IDS), down_tiles.num_tiles,
                   down_tiles.tile_info, u64("sorted_row", S("sorted_row")), u64("sorted_pair", S("sorted_pair")),
                   u64("inter", W("inter")), L("down_a"), L("down_b"), L("scale"), u64("topk_w", S("topk_w")),
                   u64("yw", S("yw")), *sizes), lora_grouped_smem(lora.max_rank, False))
    return gate_up, down


class _Builder:
    def __init__(self, lp: LayerPlan, dev: DeviceFacts, n: int, path: Path, separated: bool):
        self.lp, self.dev, self.n, self.path, self.cfg = lp, dev, n, path, lp.cfg
        self.exact = path != Path.PREFILL  # decode plans serve one row count: values of N are plain ints
        self.shape = prefill_shape(lp, dev, n) if not self.exact else None
        self.pdl = lp.pdl and path == Path.DECODE and not separated
        self.steps: list = []
        self.stage = Stage.ROUTER
        self.has_shared = lp.has_shared
        self.given_routing = False  # the experts-only entry: the call's ids and weights, no router
        self.slot_active = False  # a one-block list builder made slot_active (the sort stage sets it)

    # --- helpers -------------------------------------------------------------------------------
    def v(self, name: str, fn):
        """A value of N: a plain int in an exact plan, a PerN in a bucket plan."""
        return fn(self.n) if self.exact else PerN(name, fn)

    def launch(self, kernel: str, grid, block, args, smem=0, pdl: bool = False) -> None:
        self.steps.append(Launch(self.stage, kernel, tuple(grid), tuple(block), tuple(args), smem, pdl))

    def rows(self):
        return self.v("N", lambda n: n)

    def pairs(self):
        k = self.cfg.num_experts_per_tok
        return self.v("N*k", lambda n: n * k)

    def w8a8_args(self) -> tuple:
        """The fp8 experts' inputs' codes and scales (x's own for a shared expert behind a norm), the activation's."""
        if not self.lp.w8a8:
            return ()
        shared = ("qx_shared", "sx_shared") if self.lp.w8a8_shared_x else ("qx", "sx")
        return (u64("qa", S("qx")), u64("sa", S("sx")), u64("qa_shared", S(shared[0])),
                u64("sa_shared", S(shared[1])), u64("q_out", S("qact")), u64("s_out", S("sact")))

    def x_codes(self) -> tuple:
        """Where x's e4m3 codes go, if a stage that reads x anyway must make them (w8a8)."""
        if self.lp.w8a8 and not self.cfg.pre_expert_norm:
            return (S("qx"), S("sx"))
        if self.lp.w8a8 and self.lp.w8a8_shared_x:
            return (S("qx_shared"), S("sx_shared"))
        return (0, 0)

    # --- the plan -------------------------------------------------------------------------------
    def build(self) -> ForwardPlan:
        cfg, n = self.cfg, self.n
        H = cfg.hidden_size
        if self.given_routing:
            self.stage = Stage.TOPK
            qx = self.x_codes()
            self.given(self.codes_ahead(qx) if self.path == Path.PREFILL else qx)  # as the routed plan makes them
            route_lists = topk_lists = False
        else:
            route_lists, topk_lists = self.route()
        xe = X
        if cfg.pre_expert_norm:
            self.stage = Stage.NORM
            xe = self.norm()
        self.stage = Stage.SORT
        tiles = (0, 0)
        self.slot_active = route_lists or topk_lists
        if not (route_lists or topk_lists):
            tiles = self.sort()
        if self.path == Path.ATOMIC:
            self.steps.append(Memset(Stage.SORT, S("acc"), n * H))
        if self.path == Path.PREFILL:
            self.grouped(xe, *tiles)
        else:
            self.decode(xe)
        if self.lp.all_reduce:
            self.steps.append(AllReduce(Stage.ALL_REDUCE, self.v("N*H*2", lambda m: m * H * 2)))
        return ForwardPlan(self.path, tuple(self.steps), built_for=n, shape=self.shape)

    def route(self) -> tuple[bool, bool]:
        """The router and the routing stage; returns whether the latter built the expert lists
        too (decode_route_lists, decode_topk_lists)."""
        cfg, n = self.cfg, self.n
        k, R, H = cfg.num_experts_per_tok, cfg.router_width, cfg.hidden_size
        prefill = self.path == Path.PREFILL
        route_lists = (not prefill and n <= C.ROUTE_LISTS_MAX_ROWS
                       and C.route_lists_smem_bytes(n, k, R) <= C.STATIC_SMEM_LIMIT)
        qx = self.x_codes()
        topk_lists = (self.lp.topk_lists and not prefill and not route_lists and n <= C.TOPK_LISTS_WARPS
                      and n * k <= C.SMALL_SORT_PAIRS and R <= C.TOPK_LISTS_MAX_R
                      and C.topk_lists_smem_bytes(n, k, self.lp.n_local, R) <= self.dev.max_smem)
        splits = 1
        if prefill:
            qx = self.codes_ahead(qx)
            splits = self.prefill_router()
        elif route_lists and HX.route_lists_quantizes(n, H):  # the idle routing warps make the codes
            self.decode_router((0, 0))
        else:
            splits = self.decode_router(qx, copies=HX.decode_router_copies(self.lp, n, not (route_lists or topk_lists)))
            qx = (0, 0)
        self.stage = Stage.TOPK
        self.routing(route_lists, topk_lists, qx, splits)
        return route_lists, topk_lists

    def given(self, qx: tuple) -> None:
        """The experts-only entry's routing stage: the call's ids and weights into topk_ids / topk_w
        (an id outside 0..R-1 flagged and dropped), x's e4m3 codes with them where w8a8 needs them.
        The chain's first kernel, so never a dependent launch itself."""
        cfg, warps = self.cfg, C.TOPK_WARPS
        self.launch("experts_route_in", (self.v(f"ceil(N/{warps})", lambda m: -(-m // warps)),), (warps * 32,),
                    (u64("ids_in", CallValue.TOPK_IDS), u64("w_in", CallValue.TOPK_WEIGHTS),
                     u64("ids_out", S("topk_ids")), u64("w_out", S("topk_w")), u64("err", ERR), i32("N", self.rows()),
                     i32("R", cfg.router_width), i32("k", cfg.num_experts_per_tok), u64("x", X),
                     i32("H", cfg.hidden_size), u64("qx", qx[0]), u64("sx", qx[1])))

    # --- router and top-k ------------------------------------------------------------------------
    def codes_ahead(self, qx: tuple) -> tuple:
        """w8a8 prefill: x's e4m3 codes and scales into `qx` ahead of the router, a 256-column unit a warp
        over the whole grid, so topk_route routes only. Returns what the routing stage is to write: none."""
        if qx == (0, 0):
            return qx
        H, warps = self.cfg.hidden_size, C.X_CODES_WARPS
        units = -(-H // 256)
        self.launch("x_codes_e4m3", (self.v(f"ceil(N*{units}/{warps})", lambda m: -(-m * units // warps)),),
                    (warps * 32,), (u64("x", X), i32("N", self.rows()), i32("H", H), u64("qx", qx[0]),
                                    u64("sx", qx[1])))
        return (0, 0)

    def prefill_router(self) -> int:
        """The router's logits as a grouped GEMM on tensor cores; returns its K splits."""
        cfg, shape = self.cfg, self.shape
        H, R = cfg.hidden_size, cfg.router_width
        gk = HX.grouped_kernel(self.lp, self.dev, GemmMode.ROUTER, shape.router_config)
        bm = gk.bm
        zeros = [u64(name, 0) for name in ("xe", "act_in", "num_tiles", "tile_info", "sorted_row", "sorted_pair")]
        self.launch(gk.name, (-(-R // gk.bn), self.v(f"ceil(N/{bm})", lambda n: -(-n // bm)), shape.router_splits),
                    (gk.threads,),
                    (u64("x", X), *zeros, u64("w0_ptrs", W("router")), u64("w1_ptrs", 0),
                     u64("b0_ptrs", W("router_bias")), u64("b1_ptrs", 0),
                     *(u64(name, 0) for name in ("s0_ptrs", "s1_ptrs", "gs0", "gs1", "slot_fmt", "inter", "topk_w")),
                     i32("shared_slot", 0), i32("H", H), i32("I_max", R), i32("P", self.rows()),
                     u64("out", S("logits")), i32("act_code", 0), f32("alpha", 0.0), f32("limit", 0.0)),
                    gk.smem)
        return shape.router_splits

    def decode_router(self, qx: tuple, logits: Buf = S("logits"), copies: int = 0) -> int:
        """The decode path's router logits; with `qx`, x's e4m3 codes and scales too (w8a8); with
        `copies`, K split into that many logits copies (router_logits_split). Returns the copies."""
        cfg, n = self.cfg, self.n
        R, H = cfg.router_width, cfg.hidden_size
        args = (u64("x", X), u64("W", W("router")), u64("bias", W("router_bias")), u64("logits", logits),
                i32("N", n), i32("R", R), i32("H", H), u64("qx", qx[0]), u64("sx", qx[1]))
        if copies:
            nt = HX.row_tile(-(-n // 8), C.ROUTER_SPLIT_TILES)
            self.launch(f"router_logits_split<{nt}>", (-(-R // C.ROUTER_MMA_COLS), copies, -(-n // (8 * nt))),
                        (C.ROUTER_MMA_THREADS,), args)
            return copies
        if HX.router_on_tensor_cores(self.lp, n):
            nt = HX.row_tile(-(-n // 8), C.ROUTER_MMA_TILES)
            self.launch(f"router_logits_mma<{nt}>", (-(-R // C.ROUTER_MMA_COLS), C.ROUTER_MMA_CLUSTER, -(-n // (8 * nt))),
                        (C.ROUTER_MMA_THREADS,), args)
            return 1
        rt = HX.row_tile(n, C.ROW_TILES)
        split = C.router_split(H)
        self.launch(f"router_logits_bf16<{rt}, {split}>", ((R + 1) // 2, -(-n // rt)), (2 * split * 32,), args)
        return 1

    def routing_args(self) -> tuple:
        cfg = self.cfg
        return (u64("logits", S("logits")), u64("corr_bias", W("correction_bias")), u64("tid2eid", W("tid2eid")),
                u64("token_ids", TOKEN_IDS), u64("ids_out", S("topk_ids")), u64("w_out", S("topk_w")),
                u64("err", ERR), i32("N", self.rows()), i32("R", cfg.router_width), i32("E", cfg.num_experts),
                i32("k", cfg.num_experts_per_tok), i32("scoring", Scoring[cfg.scoring_func.upper()]),
                i32("n_group", cfg.n_group), i32("topk_group", cfg.topk_group),
                i32("topk_then_softmax", int(cfg.topk_then_softmax)), i32("renorm", int(cfg.norm_topk_prob)),
                f32("scale", cfg.routed_scaling_factor), i32("vocab", cfg.hash_vocab_size))

    def list_args(self) -> tuple:
        lp = self.lp
        return ((u64("slot_of", W("slot_of")), i32("n_local", lp.n_local), i32("has_shared", self.has_shared))
                + tuple(u64(name, S(name)) for name in LIST_OUTPUTS))

    def routing(self, route_lists: bool, topk_lists: bool, qx: tuple, splits: int) -> None:
        cfg, n = self.cfg, self.n
        k, R = cfg.num_experts_per_tok, cfg.router_width
        group_regs = 1 if cfg.n_group > 1 else 0  # group-limited routers' rows from registers
        assert route_lists or qx == (0, 0), "x's codes are x_codes_e4m3's or the router's past decode_route_lists' rows"
        if route_lists:
            x_args = (u64("x", X), i32("H", cfg.hidden_size), u64("qx", qx[0]), u64("sx", qx[1]))
            self.launch("decode_route_lists", (1,), (C.ROUTE_LISTS_THREADS,),
                        self.routing_args() + self.list_args() + x_args, C.route_lists_smem_bytes(n, k, R), self.pdl)
        elif topk_lists:
            self.launch(f"decode_topk_lists<{group_regs}>", (1,), (C.LISTS_THREADS,),
                        self.routing_args() + self.list_args(),
                        C.topk_lists_smem_bytes(n, k, self.lp.n_local, R), self.pdl)
        else:
            warps = C.TOPK_WARPS
            self.launch(f"topk_route<{group_regs}>", (self.v(f"ceil(N/{warps})", lambda m: -(-m // warps)),),
                        (warps * 32,), self.routing_args() + (i32("splits", splits),), C.topk_route_smem_bytes(R),
                        self.pdl)

    def norm(self) -> Buf:
        cfg = self.cfg
        qxe = (S("qx"), S("sx")) if self.lp.w8a8 else (0, 0)
        self.launch("rmsnorm_bf16", (self.rows(),), (256,),
                    (u64("x", X), u64("w", W("norm_weight")), u64("y", S("xe")), i32("H", cfg.hidden_size),
                     f32("eps", cfg.rms_norm_eps), u64("qy", qxe[0]), u64("sy", qxe[1])), 0, self.pdl)
        return S("xe")

    # --- the sort ---------------------------------------------------------------------------------
    def sort(self) -> tuple[int, int]:
        """(row, slot) pairs grouped by expert, stable: one block for few pairs, else three passes
        whose scan also builds the grouped GEMMs' tiles. Returns the tile heights it built."""
        lp, cfg = self.lp, self.cfg
        k, R = cfg.num_experts_per_tok, cfg.router_width
        gate_up_bm = down_bm = 0
        if self.path == Path.PREFILL:
            config, fmt0, fp8 = self.shape.grouped_config, lp.formats[0], self.shape.fp8_variant
            gate_up_bm = HX.grouped_kernel(lp, self.dev, GemmMode.GATE_UP, config, fmt0, fp8, self.shape.sm90_gate_up).bm
            down_bm = HX.grouped_kernel(lp, self.dev, GemmMode.DOWN, config, fmt0, fp8, self.shape.sm90_down).bm
            down_bm = down_bm if down_bm != gate_up_bm else 0
        one_block = self.shape.one_block_sort if self.shape else decode_lists_in_one_block(lp, self.dev, self.n)
        if one_block:
            n_local = lp.n_local
            smem = self.v("lists_smem", lambda m: C.build_lists_smem_bytes(m * k, n_local, R))
            rounds = 1 if self.shape else -(-self.n * k // C.LISTS_THREADS)  # prefill: <= SMALL_SORT_PAIRS pairs
            self.launch(f"decode_build_lists<{rounds}>", (1,), (C.LISTS_THREADS,),
                        (u64("ids", S("topk_ids")), i32("N", self.rows()), i32("k", k), u64("slot_of", W("slot_of")),
                         i32("R", R), *self.list_args()[1:]), smem, self.pdl)
            self.slot_active = True
            return 0, 0
        self.three_pass_sort(gate_up_bm, down_bm)
        return gate_up_bm, down_bm

    def three_pass_sort(self, tile_bm: int, down_bm: int) -> None:
        lp, cfg = self.lp, self.cfg
        k, R, n_local = cfg.num_experts_per_tok, cfg.router_width, lp.n_local
        nblk = self.v("sort_blocks", lambda m: -(-m * k // C.SORT_BLOCK))
        common = (u64("ids", S("topk_ids")), i32("P", self.pairs()))
        self.launch("sort_count", (nblk,), (C.SORT_BLOCK,),
                    common + (u64("slot_of", W("slot_of")), i32("R", R), i32("n_local", n_local),
                              u64("block_counts", S("block_counts"))), n_local * 4)
        self.launch("sort_scan", (1,), (C.SORT_BLOCK,),
                    (u64("block_counts", S("block_counts")), i32("nblk", nblk), i32("n_local", n_local),
                     i32("N", self.rows()), i32("k", k), i32("has_shared", self.has_shared),
                     *(u64(b, S(b)) for b in ("num_active", "active_slot", "active_start", "active_len")),
                     i32("BM", tile_bm), u64("num_tiles", S("num_tiles")), u64("tile_info", S("tile_info")),
                     i32("BM2", down_bm), u64("num_tiles2", S("num_tiles_down")),
                     u64("tile_info2", S("tile_info_down"))))
        self.launch("sort_place", (nblk,), (C.SORT_BLOCK,),
                    common + (i32("N", self.rows()), u64("slot_of", W("slot_of")), i32("R", R), i32("n_local", n_local),
                              i32("has_shared", self.has_shared),
                              *(u64(b, S(b)) for b in ("block_counts", "active_start", "num_active", "sorted_row",
                                                       "sorted_pair", "pair_pos")), i32("k", k)),
                    C.sort_place_smem_bytes(n_local))

    # --- the decode path's experts -------------------------------------------------------------
    def decode(self, xe) -> None:
        lp, cfg, n = self.lp, self.cfg, self.n
        k = cfg.num_experts_per_tok
        max_active = max(1, min(lp.n_local, n * k) + self.has_shared)
        rows_per_expert = HX.decode_rows_per_expert(lp, n)
        self.stage = Stage.GATE_UP
        for fmt in lp.formats:  # a launch a weight format; each skips the others' experts
            dk = HX.decode_kernel(lp, self.dev, "gate_up", fmt, rows_per_expert, max_active, n)
            # by table slot: the blocks' first weight stages in flight before the lists land
            by_slot = HX.gate_up_by_slot(lp, n, max_active, self.has_shared, dk, self.slot_active)
            args = self.decode_gate_up_args(xe, fmt, by_slot and dk.name.startswith("decode_wgmma_gate_up_a8"))
            self.launch(dk.name, (dk.blocks, max_active), (dk.threads,),
                        args + self.swapab_args(dk, "gate_up", by_slot), dk.smem, self.pdl)
        self.stage = Stage.DOWN
        for fmt in lp.formats:
            dk = HX.decode_kernel(lp, self.dev, "down", fmt, rows_per_expert, max_active, n)
            self.launch(dk.name, (dk.blocks, max_active), (dk.threads,),
                        self.decode_down_args(fmt) + self.swapab_args(dk, "down"), dk.smem, self.pdl)
        self.stage = Stage.REDUCE
        self.decode_reduce(xe, OUT)

    def swapab_args(self, dk: HX.DecodeKernel, stage: str, by_slot: bool = False) -> tuple:
        """The swap-AB decode's arguments past the decode kernels' own: its weight maps (down: and
        the shared expert's slot, which picks its maps; the bf16 gate/up: slot_active where its
        grid goes by table slot, else 0); none for the other decode kernels."""
        if not dk.name.startswith("decode_swapab_"):
            return ()
        if stage == "down":
            return (u64("maps", SWAPAB_MAPS), i32("shared_slot", self.lp.n_local))
        if dk.name.startswith("decode_swapab_fp8_"):
            return (u64("maps", SWAPAB_MAPS),)
        return (u64("maps", SWAPAB_MAPS), u64("slot_active", S("slot_active") if by_slot else 0))

    def expert_list_args(self) -> tuple:
        return tuple(u64(b, S(b)) for b in ("num_active", "active_slot", "active_start", "active_len"))

    def decode_gate_up_args(self, xe, fmt: WeightFormat, slot_grid: bool) -> tuple:
        lp, cfg = self.lp, self.cfg
        a8 = ()
        if fmt == WeightFormat.FP8_BLOCK and lp.w8a8:
            a8 = self.w8a8_args() + (u64("act_tickets", S("act_tickets")),
                                     u64("slot_active", S("slot_active") if slot_grid else 0))
        return (u64("x", X), u64("xe", xe), *self.expert_list_args(), u64("sorted_row", S("sorted_row")),
                *(u64(t, W(t)) for t in ("gate", "up", "gate_scale", "up_scale", "gate_gscale", "up_gscale",
                                         "slot_fmt", "gate_bias", "up_bias", "inter")),
                i32("shared_slot", lp.n_local), u64("act", S("act")), i32("H", cfg.hidden_size),
                i32("I_max", lp.i_max), i32("act_code", Activation[cfg.hidden_act.upper()]),
                f32("alpha", cfg.swiglu_alpha), f32("limit", cfg.swiglu_limit), *a8)

    def decode_down_args(self, fmt: WeightFormat) -> tuple:
        lp, cfg, n = self.lp, self.cfg, self.n
        a8 = self.w8a8_args()[4:] if fmt == WeightFormat.FP8_BLOCK and lp.w8a8 else ()  # the activation's codes
        return (u64("act", S("act")), *self.expert_list_args(), u64("sorted_pair", S("sorted_pair")),
                *(u64(t, W(t)) for t in ("down", "down_scale", "down_gscale", "slot_fmt", "down_bias", "inter")),
                u64("topk_w", S("topk_w")), u64("y", S("y")), u64("acc", S("acc")), i32("H", cfg.hidden_size),
                i32("I_max", lp.i_max), i32("k", cfg.num_experts_per_tok), i32("P", n * cfg.num_experts_per_tok),
                i32("atomic", int(self.path == Path.ATOMIC)), *a8)

    def decode_reduce(self, xe, out) -> None:
        cfg, n = self.cfg, self.n
        H = cfg.hidden_size
        # few rows: H split over blocks until about two blocks an SM (a row alone in one block
        # is a latency chain of H / 1024 steps)
        splits = max(1, min(-(-H // (4 * C.REDUCE_THREADS)), 2 * self.dev.sm_count // n))
        self.launch("decode_reduce", (n, splits), (C.REDUCE_THREADS,),
                    (u64("x", X), u64("xe", xe), u64("ids", S("topk_ids")), u64("topk_w", S("topk_w")),
                     u64("pair_pos", S("pair_pos")), u64("y", S("y")), u64("acc", S("acc")),
                     u64("shared_gate_w", W("shared_expert_gate")), u64("out", out), i32("N", n), i32("H", H),
                     i32("k", cfg.num_experts_per_tok), i32("E", cfg.num_experts), i32("has_shared", self.has_shared),
                     i32("primary", 1 if cfg.ep_rank == 0 else 0), i32("atomic", int(self.path == Path.ATOMIC))),
                    0, self.pdl)

    # --- the prefill path's experts ---------------------------------------------------------
    def grouped(self, xe, tiles_bm: int, down_tiles_bm: int) -> None:
        """gate/up and down as grouped GEMMs over each expert's run in bm-row tiles (tile_info
        holds `tiles_bm`-row tiles where the sort built them, tile_info_down `down_tiles_bm` ones)."""
        self._tiles_bm, self._down_tiles_bm = tiles_bm, down_tiles_bm
        self.stage = Stage.GATE_UP
        for fmt in self.lp.formats:  # a launch a weight format; each skips the others' tiles
            self.grouped_gate_up(xe, fmt)
        self.stage = Stage.DOWN
        for fmt in self.lp.formats:
            self.grouped_down(xe, fmt)
        self.stage = Stage.REDUCE
        self.grouped_reduce(xe, OUT)

    def tile_bound(self, bm: int):
        cfg, lp = self.cfg, self.lp
        k, n_local, sh = cfg.num_experts_per_tok, lp.n_local, bool(self.has_shared)
        return self.v(f"tiles{bm}", lambda m: max(1, C.max_tiles(m, k, n_local, sh, bm)))

    def tile_list(self, bm: int, down: bool = False) -> tuple:
        """(num_tiles, tile_info) of bm-row tiles: down's own where the sort built it, else
        tile_info, rebuilt unless it holds them already (stream order lets the kernel before finish)."""
        if down and bm == self._down_tiles_bm:
            return u64("num_tiles", S("num_tiles_down")), u64("tile_info", S("tile_info_down"))
        if bm != self._tiles_bm:
            self.launch("make_tiles", (1,), (1024,),
                        (*self.expert_list_args(), i32("BM", bm), u64("num_tiles", S("num_tiles")),
                         u64("tile_info", S("tile_info"))))
            self._tiles_bm = bm
        return u64("num_tiles", S("num_tiles")), u64("tile_info", S("tile_info"))

    def grouped_gate_up(self, xe, fmt: WeightFormat) -> None:
        lp, cfg = self.lp, self.cfg
        gk = HX.grouped_kernel(lp, self.dev, GemmMode.GATE_UP, self.shape.grouped_config, fmt, self.shape.fp8_variant,
                               self.shape.sm90_gate_up)
        num_tiles, tile_info = self.tile_list(gk.bm)
        extra = self.w8a8_args() if fmt == WeightFormat.FP8_BLOCK else ()
        if gk.name.startswith("grouped_gemm_sm90_fp8_tma<"):
            extra += (u64("maps", FP8_MAPS),)
        if gk.name.startswith("grouped_gemm_sm90_tma<"):
            if HX.gate_up_reads_xg(lp, self.shape.sm90_gate_up):  # TMA reads the inputs in sorted order
                self.launch("gather_rows", (self.tile_bound(gk.bm),), (256,),
                            (u64("x", X), u64("xe", xe), num_tiles, tile_info, u64("sorted_row", S("sorted_row")),
                             i32("shared_slot", lp.n_local), i32("H", cfg.hidden_size), u64("xg", S("xg"))))
            extra = (u64("maps", TMA_MAPS),)
        self.launch(gk.name, (-(-lp.i_max // (gk.bn // 2)), self.tile_bound(gk.bm)), (gk.threads,),
                    (u64("x", X), u64("xe", xe), u64("act_in", 0), num_tiles, tile_info,
                     u64("sorted_row", S("sorted_row")), u64("sorted_pair", S("sorted_pair")),
                     u64("w0_ptrs", W("gate")), u64("w1_ptrs", W("up")), u64("b0_ptrs", W("gate_bias")),
                     u64("b1_ptrs", W("up_bias")), u64("s0_ptrs", W("gate_scale")), u64("s1_ptrs", W("up_scale")),
                     u64("gs0", W("gate_gscale")), u64("gs1", W("up_gscale")), u64("slot_fmt", W("slot_fmt")),
                     u64("inter", W("inter")), u64("topk_w", S("topk_w")), i32("shared_slot", lp.n_local),
                     i32("H", cfg.hidden_size), i32("I_max", lp.i_max), i32("P", self.pairs()), u64("out", S("act")),
                     i32("act_code", Activation[cfg.hidden_act.upper()]), f32("alpha", cfg.swiglu_alpha),
                     f32("limit", cfg.swiglu_limit), *extra), gk.smem)

    def grouped_down(self, xe, fmt: WeightFormat) -> None:
        lp, cfg = self.lp, self.cfg
        gk = HX.grouped_kernel(lp, self.dev, GemmMode.DOWN, self.shape.grouped_config, fmt, self.shape.fp8_variant,
                               self.shape.sm90_down)
        num_tiles, tile_info = self.tile_list(gk.bm, down=True)
        extra = ()
        if fmt == WeightFormat.FP8_BLOCK and lp.w8a8:  # the activation's codes as A; no q_out / s_out
            qact = self.w8a8_args()[4:]
            extra = (u64("qa", qact[0].value), u64("sa", qact[1].value), u64("qa_shared", qact[0].value),
                     u64("sa_shared", qact[1].value), u64("q_out", 0), u64("s_out", 0))
        if gk.name.startswith("grouped_gemm_sm90_fp8_tma<"):
            extra += (u64("maps", FP8_MAPS),)
        if gk.name.startswith("grouped_gemm_sm90_tma<"):
            extra = (u64("maps", TMA_MAPS),)
        self.launch(gk.name, (-(-cfg.hidden_size // gk.bn), self.tile_bound(gk.bm)), (gk.threads,),
                    (u64("x", X), u64("xe", xe), u64("act_in", S("act")), num_tiles, tile_info,
                     u64("sorted_row", S("sorted_row")), u64("sorted_pair", S("sorted_pair")),
                     u64("w0_ptrs", W("down")), u64("w1_ptrs", 0), u64("b0_ptrs", W("down_bias")), u64("b1_ptrs", 0),
                     u64("s0_ptrs", W("down_scale")), u64("s1_ptrs", 0), u64("gs0", W("down_gscale")), u64("gs1", 0),
                     u64("slot_fmt", W("slot_fmt")), u64("inter", W("inter")), u64("topk_w", S("topk_w")),
                     i32("shared_slot", lp.n_local), i32("H", cfg.hidden_size), i32("I_max", lp.i_max),
                     i32("P", self.pairs()), u64("out", S("yw")), i32("act_code", 0), f32("alpha", 0.0),
                     f32("limit", 0.0), *extra), gk.smem)

    def grouped_reduce(self, xe, out) -> None:
        cfg = self.cfg
        self.launch("grouped_reduce", (self.rows(),), (256,),
                    (u64("x", X), u64("xe", xe), u64("ids", S("topk_ids")), u64("topk_w", S("topk_w")),
                     u64("pair_pos", S("pair_pos")), u64("yw", S("yw")),
                     u64("shared_gate_w", W("shared_expert_gate")), u64("out", out), i32("N", self.rows()),
                     i32("H", cfg.hidden_size), i32("k", cfg.num_experts_per_tok), i32("E", cfg.num_experts),
                     i32("has_shared", self.has_shared), i32("primary", 1 if cfg.ep_rank == 0 else 0)))


def dump_launches(lp: LayerPlan, dev: DeviceFacts, n: int, path: Path, logits_ptr: int,
                  routed_ptr: int) -> tuple[Launch, Launch]:
    """The debug dumps' two extra launches: the router's logits into `logits_ptr` (the forward's
    own share bytes with act), and the path's reduce without the shared expert into `routed_ptr`."""
    b = _Builder(lp, dev, n, Path.ATOMIC if path == Path.ATOMIC else Path.DECODE, separated=True)
    b.has_shared = 0
    b.decode_router((0, 0), logits=logits_ptr)
    xe = S("xe") if lp.cfg.pre_expert_norm else X
    if path == Path.PREFILL:
        b.grouped_reduce(xe, routed_ptr)
    else:
        b.decode_reduce(xe, routed_ptr)
    return b.steps[0], b.steps[1]
