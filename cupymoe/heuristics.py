"""Which kernel serves a stage: pure functions of the layer's plan, the GPU and the row count.

Thresholds come from cupymoe/tuning.py (measured, with the command that measured them); the
kernels' own shapes from cupymoe/catalog.py. cupymoe/forward_plan.py calls these to build a
forward's launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import catalog as C
from .catalog import GemmMode, WeightFormat
from .knobs import Bf16Decode, DecodeRouter, Fp4Decode, GateUpAhead, LoraShrink, Sm90Fp8, W8a8Decode
from .plan import DeviceFacts, LayerPlan
from .tuning import TUNING

# the CUDA-core decode kernels aim for one wave of resident warps on the H200 they were tuned on
RESIDENT_WARPS = 132 * C.WARPS_PER_SM


@dataclass(frozen=True)
class GroupedKernel:
    name: str
    threads: int
    smem: int
    bn: int  # weight rows a tile (gate/up: half gate, half up)
    bm: int  # rows a tile (the sort builds tiles of this height)


@dataclass(frozen=True)
class DecodeKernel:
    name: str
    blocks: int  # column blocks (the grid's x; its y the active experts, or the table slots: gate_up_by_slot)
    threads: int
    smem: int
    # gate/up: the weight bytes a block copies before the lists land where its grid goes by table
    # slot (gate_up_by_slot); 0: the kernel has no such form
    ahead_bytes: int = 0


def row_tile(rows: float, tiles: tuple[int, ...]) -> int:
    """Smallest tile holding `rows` expected rows, capped at the largest variant."""
    for t in tiles:
        if t >= rows:
            return t
    return tiles[-1]


def cols_per_warp(warp_columns: int, rt: int, variants) -> int:
    """Fewest columns a warp that cover `warp_columns` in about one wave of resident warps (a
    partial second wave would leave most SMs idle at its end)."""
    allowed = [c for r, c in variants if r == rt]
    for c in allowed:
        if warp_columns / c <= RESIDENT_WARPS:
            return c
    return allowed[-1]


def gate_up_ahead_waste(n_local: int, num_experts: int, k: int, num_tokens: int, blocks: int,
                        block_bytes: int) -> float:
    """Bytes a decode gate/up by table slot is expected to copy for nothing at `num_tokens` rows:
    the experts nobody chose (each with chance (1 - k/E)^N), each its `blocks` column blocks'
    `block_bytes` of first weight stages."""
    E = max(num_experts, 1)
    idle = n_local * (1.0 - min(k, E) / E) ** num_tokens
    return idle * blocks * block_bytes


def gate_up_by_slot(lp: LayerPlan, n: int, max_active: int, has_shared: bool, dk: DecodeKernel,
                    slot_active: bool) -> bool:
    """Whether a decode gate/up of `n` rows goes by table slot (its blocks' first weight stages in
    flight before the lists land): a kernel with that form (dk.ahead_bytes), a one-block list
    builder made slot_active (`slot_active`), every slot a row of the grid; then the knob, or in
    auto where the experts nobody chose would copy at most gate_up_ahead_max_waste bytes."""
    if (not dk.ahead_bytes or lp.gate_up_ahead == GateUpAhead.OFF or not slot_active
            or max_active != lp.n_local + has_shared):
        return False
    if lp.gate_up_ahead == GateUpAhead.ON:
        return True
    waste = gate_up_ahead_waste(lp.n_local, lp.cfg.num_experts, lp.cfg.num_experts_per_tok, n, dk.blocks,
                                dk.ahead_bytes)
    return waste <= TUNING.gate_up_ahead_max_waste


def route_lists_quantizes(num_tokens: int, hidden_size: int) -> bool:
    """Whether decode_route_lists' idle warps (one a row not routed) make x's e4m3 codes, rather than the router."""
    idle = C.ROUTE_LISTS_THREADS // 32 - num_tokens
    return idle > 0 and num_tokens * -(-hidden_size // 256) <= TUNING.route_lists_quant_units * idle


# --- the grouped (prefill) path ---------------------------------------------------------------

def grouped_config(lp: LayerPlan, n: int) -> str:
    """"math" (128-row tiles) once the average expert run fills enough of them, else "stream"
    (the tuning table's measured choice for this shape and N bucket where it has one); w8a8's
    tiles are 64 rows, and every format of the layer takes them."""
    if lp.w8a8:
        return "stream"
    tuned = lp.choice(n).grouped
    if tuned is not None:
        return tuned
    return "math" if n * lp.cfg.num_experts_per_tok >= lp.math_rows * lp.n_local else "stream"


# The stacked LoRA form's shrinks by (tile, adapter) segments from this many rows (CUPYMOE_LORA_STACK_SHRINK
# =auto): segments won at 4096 rows and lost at 1024 in w8a16 (benchmarks/DECISIONS.md "LoRA: the stacked
# shrinks by segments"); the expert pieces lost to them at 4096 ("... by expert pieces").
LORA_SEGMENTS_FROM_ROWS = 2049


# The LoRA router delta folded into the router and routing launches up to this many decode rows
# (CUPYMOE_LORA_FOLD; forward_plan.lora_fold): measured at one row, where the chain's links bound
# the LoRA cost (benchmarks/DECISIONS.md "LoRA: the router delta folded into the router and routing").
LORA_FOLD_ROWS = 1


# The prefill router's LoRA shrink as more column tiles of the router GEMM, its expand inside
# top-k, up to this many rows (CUPYMOE_LORA_ROUTER_T_ROWS; forward_plan.lora_router_t)
LORA_ROUTER_T_ROWS = 1024


# The decode's LoRA gate/up shrinks as blocks of the bf16 swap-AB gate/up (CUPYMOE_LORA_SWAPAB=auto) from this
# many routed pairs a (expert, adapter slot) (an expert-parallel rank's experts get their share of the
# pairs): the per-pair shrinks then read each slot's A about this many times over, the swap-AB form once
# an expert's NT-row pass. At one pair a slot (qwen3-30b-a3b, 4 slots, 64
# rows) the per-pair kernels, streaming in gate/up's last wave, won; at two (128 rows) and four (256)
# the swap-AB form (benchmarks/DECISIONS.md "LoRA: the decode's gate/up shrinks in the swap-AB gate/up").
LORA_SWAPAB_PAIRS_A_SLOT = 2


def lora_swapab_rows(lp: LayerPlan, n: int, max_loras: int) -> bool:
    """Whether CUPYMOE_LORA_SWAPAB=auto takes the swap-AB form at a decode of n rows with max_loras slots."""
    return n * lp.cfg.num_experts_per_tok >= LORA_SWAPAB_PAIRS_A_SLOT * lp.cfg.num_experts * max_loras


# Below LORA_SEGMENTS_FROM_ROWS a stacked shrink whose K (gate/up: H; down: the experts' I_max) is at
# most this many columns goes by expert pieces, a block an (expert, adapter) with its rows 64 at a time
# against A streamed once; a longer K stays with the chunks, whose warps split it (DECISIONS "LoRA: the
# stacked shrinks by expert pieces": qwen3-30b-a3b 1024 rows, H 2048 and I 768).
LORA_EXPERTS_MAX_K = 2048


def lora_shrink_form(n: int, k: int) -> LoraShrink:
    """The form CUPYMOE_LORA_STACK_SHRINK=auto takes for a stacked shrink over K = k at a prefill of n rows."""
    if n >= LORA_SEGMENTS_FROM_ROWS:
        return LoraShrink.SEGMENTS
    return LoraShrink.EXPERTS if k <= LORA_EXPERTS_MAX_K else LoraShrink.CHUNKS


def sm90_fp8_variant(lp: LayerPlan, n: int) -> str:
    """The w8a8 grouped GEMM of a prefill of `n` rows: "tma" or "tma64" (grouped_sm90_fp8_tma.cu's two
    forms) where it serves and CUPYMOE_SM90_FP8_VARIANT or the tuning table's entry for the N bucket
    asks for it, else "cp_async" (grouped_sm90_fp8.cu). All give the same bits (fp8_gemm.cuh)."""
    if not (lp.w8a8 and lp.fp8_tma_ok):
        return "cp_async"
    if lp.sm90_fp8 != Sm90Fp8.AUTO:
        return lp.sm90_fp8.value
    return lp.choice(n).sm90_fp8 or "cp_async"


def sm90_variant_fits(lp: LayerPlan, mode: GemmMode, name: str) -> bool:
    """Whether the bf16 TMA GEMM variant `name` may serve the layer's gate/up or down in place of its
    own (lp.sm90): both by TMA, the same weight rows a tile (the layer's tensor maps' boxes), and
    for gate/up one that gathers its rows itself unless the layer keeps the gathered inputs (xg)."""
    v, own = TUNING.sm90_variants[name], lp.sm90[mode]
    return v.tma and own.tma and v.bn == own.bn and (mode == GemmMode.DOWN or v.gather or lp.gathers_rows)


def sm90_variant(lp: LayerPlan, mode: GemmMode, n: int) -> Optional[str]:
    """The tuning table's bf16 TMA GEMM variant of gate/up or down for a prefill of `n` rows where
    it fits the layer (sm90_variant_fits), else None: the layer's own (lp.sm90)."""
    c = lp.choice(n)
    name = c.sm90_gate_up if mode == GemmMode.GATE_UP else c.sm90_down
    return name if name and sm90_variant_fits(lp, mode, name) else None


def sm90_of(lp: LayerPlan, mode: GemmMode, variant: Optional[str]) -> C.Sm90Variant:
    """The Hopper GEMM configuration named `variant` (sm90_variant's pick), or the layer's own for `mode`."""
    return TUNING.sm90_variants[variant] if variant else lp.sm90[mode]


def gate_up_reads_xg(lp: LayerPlan, variant: Optional[str]) -> bool:
    """Whether the bf16 TMA gate/up (`variant`, or the layer's) reads its inputs gathered into xg by
    gather_rows (the gathering variants copy the rows themselves)."""
    v = sm90_of(lp, GemmMode.GATE_UP, variant)
    return v.tma and not v.gather


def grouped_kernel(lp: LayerPlan, dev: DeviceFacts, mode: GemmMode, config: str,
                   fmt: WeightFormat = WeightFormat.BF16, fp8: str = "cp_async",
                   variant: Optional[str] = None) -> GroupedKernel:
    """fp8 as w8a8 on its own Hopper kernels (`fp8`: sm90_fp8_variant's pick); wgmma where the
    math config runs and the weights are bf16 or fp4 (not for row-invariant layers, whose every
    N must run the same instructions; `variant`: sm90_variant's name in place of the layer's);
    else the mma.sync kernel (quantized weights in their streaming configuration)."""
    keep = mode == GemmMode.GATE_UP and lp.keep_w8a8_activation  # the bf16 activation stored too (inspection)
    if fmt == WeightFormat.FP8_BLOCK and lp.w8a8 and fp8 in C.FP8_TMA_SHAPES:
        shape = C.FP8_TMA_SHAPES[fp8]
        return GroupedKernel(C.sm90_fp8_kernel(mode, True, keep, shape.wgs), shape.threads, shape.smem_bytes(),
                             C.SM90_FP8_TMA_BN, shape.bm)
    if fmt == WeightFormat.FP8_BLOCK and lp.w8a8:
        bm, bn = C.SM90_FP8_TILE[:2]
        return GroupedKernel(C.sm90_fp8_kernel(mode, False, keep), C.SM90_FP8_THREADS, C.sm90_fp8_smem_bytes(), bn,
                             bm)
    v = sm90_of(lp, mode, variant)
    if config == "math" and v.serves(fmt, mode) and dev.hopper and not lp.row_invariant:
        return GroupedKernel(v.kernel(mode, fmt), v.threads(mode), v.smem_bytes(fmt), v.bn, v.bm)
    config = TUNING.quant_grouped_config[config] if fmt else config
    c = TUNING.grouped_configs[config]
    name, threads, smem = C.grouped_kernel(mode, c.bm, c.bk, c.stages, fmt)
    return GroupedKernel(name, threads, smem, C.GROUPED_BN, c.bm)


def router_config(lp: LayerPlan, dev: DeviceFacts, n: int) -> str:
    """The prefill router's tiles: "math" (128 x 128) from router_math_min_rows rows, unless
    they would leave over half the SMs idle (a narrow router), then "stream"'s smaller ones."""
    if n < TUNING.router_math_min_rows:
        return "stream"
    if -(-lp.cfg.router_width // 128) * -(-n // 128) * 2 < dev.sm_count:
        return "stream"
    return "math"


def router_splits(lp: LayerPlan, dev: DeviceFacts, tiles: int) -> int:
    """K splits of the prefill router: enough for two blocks an SM where its tiles are few,
    each split at least 4 steps of 64; none for row-invariant layers (a split sums in another order)."""
    if lp.row_invariant:
        return 1
    steps = -(-lp.cfg.hidden_size // 64)
    return max(1, min(C.ROUTER_MAX_SPLITS, 2 * dev.sm_count // max(1, tiles), steps // 4))


def router_macs(lp: LayerPlan, n: int) -> int:
    """The router's multiply-adds R N H for `n` rows (what the decode routers' thresholds measure)."""
    return lp.cfg.router_width * n * lp.cfg.hidden_size


def router_on_tensor_cores(lp: LayerPlan, n: int) -> bool:
    """Whether the decode router for `n` rows is router_mma.cu's (tensor cores)."""
    if lp.decode_router == DecodeRouter.AUTO:
        return router_macs(lp, n) >= TUNING.decode_router_mma_min_macs
    return lp.decode_router in (DecodeRouter.MMA, DecodeRouter.SPLIT)


def decode_router_copies(lp: LayerPlan, n: int, topk_routes: bool) -> int:
    """Logits copies of router_logits_split (its K splits) for `n` rows where it runs: where topk_route,
    which sums the copies, routes the rows, from its own measured R N H under auto (below the cluster
    router's), always under split; 0 where another router runs (DECISIONS "The decode router's K over the grid")."""
    if not topk_routes or lp.decode_router in (DecodeRouter.MMA, DecodeRouter.CORES):
        return 0
    if lp.decode_router == DecodeRouter.AUTO and router_macs(lp, n) < TUNING.decode_router_split_min_macs:
        return 0
    return C.router_split_copies(lp.cfg.hidden_size)


# --- the decode path --------------------------------------------------------------------------

def decode_kernel(lp: LayerPlan, dev: DeviceFacts, stage: str, fmt: WeightFormat, rows_per_expert: float,
                  max_active: int, n_rows: int = 0) -> DecodeKernel:
    """A decode stage ("gate_up" or "down") of a forward of `n_rows` rows for the experts of format
    `fmt`: the swap-AB kernels where chosen (bf16, fp8 as w8a8), else the wgmma kernels where they
    take it (fp8 as w8a8, fp4), else decode_mma.cu's or decode.cu's."""
    if fmt in C.SWAPAB_FORMATS and swapab_decode(lp, n_rows):
        return swapab_decode_kernel(lp, stage, n_rows, fmt)
    wg = (w8a8_decode_kernel(lp, dev, stage, rows_per_expert, max_active, n_rows)
          if fmt == WeightFormat.FP8_BLOCK
          else fp4_wgmma_decode_kernel(lp, dev, stage, fmt, rows_per_expert, max_active, n_rows)
          if fmt in lp.mma_decode_formats else None)
    if wg is not None:
        return wg
    columns = lp.i_max if stage == "gate_up" else lp.cfg.hidden_size
    name, blocks = register_decode_kernel(lp, dev, stage, fmt, rows_per_expert, columns, max_active)
    return DecodeKernel(name, blocks, 256, 0)


def swapab_decode(lp: LayerPlan, n_rows: int) -> bool:
    """Whether the decode of `n_rows` rows runs the swap-AB kernels (decode_swapab_sm90.cu for bf16,
    decode_swapab_fp8_sm90.cu for fp8 as w8a8): where they serve (lp.swapab_ok),
    CUPYMOE_DECODE_KERNEL's choice, else the tuning table's for the N bucket (off where it has none)."""
    if not lp.swapab_ok:
        return False
    if lp.decode_kernel != Bf16Decode.AUTO:
        return lp.decode_kernel == Bf16Decode.SWAPAB
    return bool(n_rows) and lp.choice(n_rows).decode_kernel == "swapab"


def expert_mean_rows(lp: LayerPlan, n_rows: int) -> float:
    """Rows a routed expert gets on average at `n_rows` rows (k picks a row over the local experts)."""
    return n_rows * lp.cfg.num_experts_per_tok / max(lp.n_local, 1)


def decode_rows_per_expert(lp: LayerPlan, n_rows: int) -> float:
    """The rows an expert the decode kernels' rules size their passes for: twice the mean, at least 1."""
    return max(1.0, 2.0 * expert_mean_rows(lp, n_rows))


def swapab_busy_rows(lp: LayerPlan, n_rows: int) -> float:
    """Rows a busy routed expert gets at `n_rows` rows: the mean plus four of its Poisson
    deviations, plus 2. An expert past its token tile streams its weights once more a pass,
    while a wider tile costs only shared memory and idle tensor-core work."""
    mean = expert_mean_rows(lp, n_rows)
    return mean + 4.0 * mean ** 0.5 + 2.0


def _swapab_tiles(fp8: bool) -> tuple[int, ...]:
    return C.SWAPAB_FP8_TOKEN_TILES if fp8 else C.SWAPAB_TOKEN_TILES


def swapab_token_tile(lp: LayerPlan, n_rows: int, fp8: bool) -> int:
    """The swap-AB decodes' token tile at `n_rows` rows: the tuning table's for the N bucket where its
    row chose the swap-AB kernels and names a tile they have, else the smallest holding swapab_busy_rows."""
    tiles = _swapab_tiles(fp8)
    choice = lp.choice(n_rows) if n_rows else None
    tuned = choice.token_tile if choice and choice.decode_kernel == "swapab" else None
    return tuned if tuned in tiles else row_tile(swapab_busy_rows(lp, n_rows), tiles)


def swapab_holds_busy_expert(lp: LayerPlan, n_rows: int, fp8: bool) -> bool:
    """Whether the format's widest swap-AB token tile holds a busy expert's rows (swapab_busy_rows) at
    `n_rows` rows: past it every expert streams its weights once a pass, and the grouped GEMMs'
    tiles are full enough to take over."""
    return swapab_busy_rows(lp, n_rows) <= _swapab_tiles(fp8)[-1]


def swapab_smaller_tiles(lp: LayerPlan, n_rows: int, fp8: bool) -> tuple[int, ...]:
    """The token tiles below the rule's (swapab_busy_rows: four Poisson deviations) worth timing at
    `n_rows` rows: down to the smallest holding an expert one deviation above its mean. A smaller
    tile sends the busier experts (and a shared expert's N rows) through more passes; a wider one
    carries more token bytes a stage and, at 64, one stage fewer."""
    tiles, mean = _swapab_tiles(fp8), expert_mean_rows(lp, n_rows)
    lo, rule = row_tile(mean + mean ** 0.5, tiles), row_tile(swapab_busy_rows(lp, n_rows), tiles)
    return tuple(t for t in tiles if lo <= t < rule)


def swapab_decode_kernel(lp: LayerPlan, stage: str, n_rows: int,
                         fmt: WeightFormat = WeightFormat.BF16) -> DecodeKernel:
    """decode_swapab_{stage}<NT> (bf16) or decode_swapab_fp8_{stage}<NT> (fp8 as w8a8): NT
    swapab_token_tile's (an expert with more rows, or the shared expert's N rows, takes passes of
    NT). gate/up: 64 activation columns a block; down:
    128 hidden columns."""
    fp8 = fmt == WeightFormat.FP8_BLOCK
    nt = swapab_token_tile(lp, n_rows, fp8)
    columns, per_block = ((lp.i_max, C.SWAPAB_GATE_UP_COLUMNS) if stage == "gate_up"
                          else (lp.cfg.hidden_size, C.SWAPAB_ROWS))
    name = f"decode_swapab_fp8_{stage}<{nt}>" if fp8 else f"decode_swapab_{stage}<{nt}>"
    smem = C.swapab_fp8_smem_bytes(nt) if fp8 else C.swapab_smem_bytes(nt)
    # the bf16 gate/up's by-slot form copies its ring's first stages (two m64 weight tiles each) ahead
    steps = min(C.SWAPAB_STAGES[nt], -(-lp.cfg.hidden_size // C.SWAPAB_BK))
    ahead = steps * C.SWAPAB_ROWS * C.SWAPAB_BK * 2 if stage == "gate_up" and not fp8 else 0
    return DecodeKernel(name, -(-columns // per_block), C.SWAPAB_THREADS, smem, ahead)


def _wgmma_gate_up_blocks(lp: LayerPlan) -> int:
    """Column blocks of a wgmma decode gate/up launch (64 activation columns a block)."""
    return -(-lp.i_max // C.WGMMA_DECODE_GATE_UP_COLUMNS)


def _fills_waves(blocks: int, max_active: int, min_waves: float, blocks_per_sm: int, dev: DeviceFacts) -> bool:
    """Whether a grid of `blocks` x `max_active` holds `min_waves` waves of `blocks_per_sm` blocks an SM."""
    return blocks * max_active >= min_waves * (blocks_per_sm * dev.sm_count)


def w8a8_decode_wgmma(lp: LayerPlan, dev: DeviceFacts, max_active: int, n_rows: int = 0) -> bool:
    """Whether w8a8 decode of `n_rows` rows runs decode_wgmma_a8.cu: the knob's choice, else the
    tuning table's for the N bucket, else where its gate/up grid holds wgmma_decode_min_waves waves."""
    if lp.w8a8_decode != W8a8Decode.AUTO:
        return lp.w8a8_decode == W8a8Decode.WGMMA
    tuned = lp.choice(n_rows).w8a8_decode if n_rows else None
    if tuned is not None:
        return tuned == "wgmma"
    return _fills_waves(_wgmma_gate_up_blocks(lp), max_active, TUNING.wgmma_decode_min_waves,
                        C.WGMMA_DECODE_BLOCKS_PER_SM, dev)


def w8a8_decode_kernel(lp: LayerPlan, dev: DeviceFacts, stage: str, rows_per_expert: float,
                       max_active: int, n_rows: int = 0) -> Optional[DecodeKernel]:
    """decode_wgmma_a8.cu's launch, or None where decode_mma.cu's _a8 kernels serve (w8a16, or
    w8a8_decode_wgmma says no). A pass takes a8_token_tile's rows."""
    if not lp.w8a8 or not w8a8_decode_wgmma(lp, dev, max_active, n_rows):
        return None
    H, i_max, gate_up_blocks = lp.cfg.hidden_size, lp.i_max, _wgmma_gate_up_blocks(lp)
    nt = a8_token_tile(lp, rows_per_expert, n_rows)
    tiles = 1 if stage == "gate_up" else a8_down_tiles(lp, dev, n_rows)
    blocks, k = (gate_up_blocks, H) if stage == "gate_up" else (-(-H // C.WGMMA_DECODE_ROWS) // tiles, i_max)
    # its gate/up's by-slot form copies the ring's first stages but one ahead
    ahead = C.wgmma_decode_ahead_bytes(nt) if stage == "gate_up" else 0
    return DecodeKernel(f"decode_wgmma_{stage}_a8<{nt}>", blocks, C.WGMMA_DECODE_THREADS,
                        C.wgmma_decode_smem_bytes(nt, -(-k // 128), tiles), ahead)


def a8_token_tile(lp: LayerPlan, rows_per_expert: float, n_rows: int = 0) -> int:
    """Rows a pass of the w8a8 wgmma decode takes at `n_rows` rows: the tuning table's tile for the N
    bucket where its row chose decode/wgmma and names one, else the smallest of 8, 16, 32 holding
    `rows_per_expert` (an expert with more rows takes more passes, each streaming its weights again)."""
    choice = lp.choice(n_rows) if n_rows else None
    if choice and choice.w8a8_decode == "wgmma" and choice.token_tile in C.WGMMA_DECODE_TOKEN_TILES:
        return choice.token_tile
    return row_tile(rows_per_expert, C.WGMMA_DECODE_TOKEN_TILES)


def a8_token_tiles_to_time(lp: LayerPlan, rows_per_expert: float) -> tuple[int, ...]:
    """The wgmma decode's token tiles other than the rule's (a8_token_tile) worth timing: the wider ones,
    which take the busy experts' rows in fewer passes for a few more rows' bytes a stage."""
    rule = row_tile(rows_per_expert, C.WGMMA_DECODE_TOKEN_TILES)
    return tuple(t for t in C.WGMMA_DECODE_TOKEN_TILES if t > rule)


def a8_down_tiles(lp: LayerPlan, dev: DeviceFacts, n_rows: int) -> int:
    """128-row tiles a block of decode_wgmma_down_a8 takes through one ring (H must be a multiple
    of 128 whose tiles the count divides: the kernel's rows all lie in the matrix, else one):
    CUPYMOE_A8_DOWN_TILES's count, else the most of 4 and 2 where every expert's I is at most
    a8_down_tiles_max_k_steps k128 steps and the experts `n_rows` rows are expected to choose
    still give a8_down_tiles_min_waves waves of such blocks, else one."""
    tiles_h, whole = divmod(lp.cfg.hidden_size, C.WGMMA_DECODE_ROWS)
    if lp.a8_down_tiles is not None:
        return C.forced_down_tiles(lp.a8_down_tiles, lp.cfg.hidden_size)
    if whole or -(-lp.i_max // 128) > TUNING.a8_down_tiles_max_k_steps:  # K of every expert in the launch
        return 1
    active = expected_experts(lp, max(1, n_rows))
    for t in (4, 2):
        if tiles_h % t == 0 and _fills_waves(tiles_h // t, active, TUNING.a8_down_tiles_min_waves,
                                             C.WGMMA_DECODE_BLOCKS_PER_SM, dev):
            return t
    return 1


def expected_experts(lp: LayerPlan, n_rows: int) -> float:
    """Local experts that `n_rows` rows are expected to choose (each with chance 1 - (1 - k/E)^N)."""
    k, E = lp.cfg.num_experts_per_tok, lp.cfg.num_experts
    return lp.n_local * (1.0 - (1.0 - min(1.0, k / E)) ** n_rows)


def fp4_wgmma_decode_kernel(lp: LayerPlan, dev: DeviceFacts, stage: str, fmt: WeightFormat, rows_per_expert: float,
                            max_active: int, n_rows: int = 0) -> Optional[DecodeKernel]:
    """decode_wgmma_fp4.cu's launch, or None where decode_mma.cu's fp4 kernels serve: mode mma, a
    K it cannot read, or in auto a gate/up grid under wgmma_fp4_decode_min_waves of a wave."""
    if lp.fp4_decode == Fp4Decode.MMA or not lp.fp4_wgmma_ok:
        return None
    H, gate_up_blocks = lp.cfg.hidden_size, _wgmma_gate_up_blocks(lp)
    if lp.fp4_decode == Fp4Decode.AUTO and not _fills_waves(gate_up_blocks, max_active, TUNING.wgmma_fp4_decode_min_waves,
                                                           C.WGMMA_FP4_DECODE_BLOCKS_PER_SM, dev):
        return None
    nt = 8 if rows_per_expert <= 8 else 16
    blocks = gate_up_blocks if stage == "gate_up" else H // (C.WGMMA_DECODE_ROWS * fp4_down_tiles(lp, dev, n_rows))
    return DecodeKernel(f"decode_wgmma_{stage}_fp4<{int(fmt)}, {nt}>", blocks, C.WGMMA_DECODE_THREADS,
                        C.wgmma_fp4_decode_smem_bytes(fmt, nt))


def fp4_down_tiles(lp: LayerPlan, dev: DeviceFacts, n_rows: int) -> int:
    """128-row tiles a block of decode_wgmma_down_fp4 takes: two where the experts' I is at most
    fp4_down_tiles_max_stages ring stages and the experts `n_rows` rows are expected to choose
    give a wave of such blocks, else one; CUPYMOE_FP4_DOWN_TILES forces a count (one where it
    does not divide H / 128)."""
    cfg = lp.cfg
    tiles_h = cfg.hidden_size // C.WGMMA_DECODE_ROWS  # a multiple of 128 where this kernel serves (fp4_wgmma_ok)
    if lp.fp4_down_tiles is not None:
        return C.forced_down_tiles(lp.fp4_down_tiles, cfg.hidden_size)
    stages = -(-cfg.moe_intermediate_size // (C.WGMMA_FP4_DECODE_KSUB * 128))
    if tiles_h % 2 or stages > TUNING.fp4_down_tiles_max_stages:
        return 1
    fills = _fills_waves(tiles_h // 2, expected_experts(lp, n_rows), 1.0, C.WGMMA_FP4_DECODE_BLOCKS_PER_SM, dev)
    return 2 if fills else 1


def register_decode_kernel(lp: LayerPlan, dev: DeviceFacts, stage: str, fmt: WeightFormat, rows_per_expert: float,
                           columns: int, max_active: int) -> tuple[str, int]:
    """(kernel, column blocks) of the register-direct decode: fp4 and fp8 on tensor cores
    (decode_mma.cu: the fewest K splits that still put enough blocks on every SM, 16-token
    passes past 8 rows), else decode.cu's CUDA-core stream (the row tile holding those rows,
    the fewest columns a warp that fill one wave)."""
    a8 = fmt == WeightFormat.FP8_BLOCK and lp.w8a8
    if a8 or fmt in lp.mma_decode_formats:
        nt = 2 if rows_per_expert > 8 else 1
        want = lp.mma_blocks_per_sm * dev.sm_count
        pairs = -(-columns // (32 * 8))  # down: two fragments a warp where half the blocks fill every SM
        if stage == "down" and lp.mma_down_pairs and pairs * max_active >= want:
            return (f"decode_mma_down_a8<1, {nt}, 2>" if a8 else f"decode_mma_down<{int(fmt)}, 1, {nt}, 2>"), pairs
        for ks in C.MMA_DECODE_K_SPLITS:
            blocks = -(-columns // (16 * 8 // ks))
            if blocks * max_active >= want:
                break
        return (f"decode_mma_{stage}_a8<{ks}, {nt}>" if a8 else f"decode_mma_{stage}<{int(fmt)}, {ks}, {nt}>"), blocks
    rt = row_tile(rows_per_expert, C.GATE_UP_ROW_TILES if stage == "gate_up" else C.ROW_TILES)
    cw = cols_per_warp(max_active * columns, rt, C.GATE_UP_VARIANTS if stage == "gate_up" else C.DOWN_VARIANTS)
    return f"decode_{stage}<{rt}, {cw}, {int(fmt)}>", -(-columns // (8 * cw))
