"""What the kernels of cuda/ are: their codes, template parameters and launch shapes.

Everything here mirrors a constant or a layout of a cuda/ file (tests/test_kernels_build.py
checks they agree); nothing here chooses between kernels (that is cupymoe/plan.py, from the
measurements of cupymoe/tuning.py) or compiles them (cupymoe/jit.py).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class WeightFormat(enum.IntEnum):
    """Expert weight formats the kernels read (cuda/quant.cuh FMT_*)."""

    BF16 = 0
    FP8_BLOCK = 1
    NVFP4 = 2
    MXFP4 = 3

    @classmethod
    def named(cls, name: str) -> "WeightFormat":
        """The format of a formats.weight_format() name ("bf16", "fp8_block", ...)."""
        return cls[name.upper()]

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def bits(self) -> int:
        return {0: 16, 1: 8, 2: 4, 3: 4}[int(self)]

    @property
    def k_multiple(self) -> int:
        """The input width a matrix of this format needs: the kernels read whole 16-byte chunks of codes."""
        return {0: 8, 1: 16, 2: 32, 3: 32}[int(self)]

    @property
    def is_fp4(self) -> bool:
        return self in (WeightFormat.NVFP4, WeightFormat.MXFP4)


class Activation(enum.IntEnum):  # cuda/common.cuh ACT_*
    SILU = 0
    GELU = 1
    GELU_TANH = 2
    SWIGLU_OAI = 3
    PAIR = 4  # not a config's: the LoRA plans' gate/up stores g and u side by side (rows 2 I_max wide)


class LoraDownMode(enum.IntEnum):  # cuda/lora.cu LORA_DOWN_*: where lora_down_delta adds
    DECODE = 0  # y, fp32, unweighted
    ATOMIC = 1  # acc (routed pairs, weighted) and y (the shared expert)
    GROUPED = 2  # yw, bf16, weighted


class Scoring(enum.IntEnum):  # cuda/routing.cuh SCORE_*
    SOFTMAX = 0
    SIGMOID = 1
    SQRTSOFTPLUS = 2


class GemmMode(enum.IntEnum):  # cuda/gemm_common.cuh: what a grouped GEMM computes
    GATE_UP = 0
    DOWN = 1
    ROUTER = 2


# the CUDA-core router and decode kernels: rows a weight pass (RT), columns a warp (CW);
# registers grow with RT * CW, so both stay at RT * CW <= 4 (down also has 1-column tiles of 8 rows)
ROW_TILES = (1, 2, 4, 8)
GATE_UP_ROW_TILES = (1, 2, 4)
DECODE_COLS = (1, 2, 4)
GATE_UP_VARIANTS = tuple((rt, cw) for rt in GATE_UP_ROW_TILES for cw in DECODE_COLS if rt * cw <= 4)
DOWN_VARIANTS = tuple((rt, cw) for rt in ROW_TILES for cw in DECODE_COLS if rt * cw <= 4 or cw == 1)
ROUTER_SPLITS = (4, 8)  # router.cu: warps splitting H a router row
# router_mma.cu: n8 tiles of rows a block, its cluster (blocks a K split), router columns a block
ROUTER_MMA_TILES = (1, 2, 4, 8)
ROUTER_MMA_CLUSTER = 8
ROUTER_MMA_COLS = 32
ROUTER_MMA_THREADS = 512
ROUTER_SPLIT_TILES = (1, 2, 4)  # router_logits_split: two k32 steps' loads a warp in flight at each
ROUTER_SPLIT_STEPS = 16  # k32 steps a copy of router_logits_split at least (two a K warp)
# decode_mma.cu: warps of a block splitting K, 8-token B fragments a pass, formats served
MMA_DECODE_K_SPLITS = (1, 2, 4, 8)
MMA_DECODE_TOKEN_TILES = (1, 2)
FP4_DECODE_FORMATS = (WeightFormat.NVFP4, WeightFormat.MXFP4)
MMA_DECODE_FORMATS = FP4_DECODE_FORMATS + (WeightFormat.FP8_BLOCK,)
# mxfp4 scale bytes the tensor-core decode serves (it scales by 2^-64 on the way and the
# weights must stay normal bf16 numbers); outside, the CUDA-core readers take them
FP4_MMA_MXFP4_SCALE_BYTES = (66, 192)
# decode_wgmma_a8.cu: rows of an expert's run a pass, and per pass height its ring (WG_STAGES(NT),
# WG_KSUB(NT): stages, k128 steps a stage), weight rows a block, threads a block (WG_ROWS / WG_THREADS)
WGMMA_DECODE_TOKEN_TILES = (8, 16, 32)
WGMMA_DECODE_RING = {8: (3, 2), 16: (3, 2), 32: (5, 1)}  # token tile -> (stages, k128 steps a stage)
WGMMA_DECODE_ROWS = 128
WGMMA_DECODE_THREADS = 128
WGMMA_DECODE_GATE_UP_COLUMNS = WGMMA_DECODE_ROWS // 2  # a gate/up block's 128 rows: 64 gate, 64 up


def forced_down_tiles(count: int, hidden: int) -> int:
    """A knob's count of 128-row tiles a wgmma decode down block takes: itself where it divides the
    H / 128 tiles (H a multiple of 128: every row of a block's tiles lies in the matrix), else one."""
    tiles_h, whole = divmod(hidden, WGMMA_DECODE_ROWS)
    return count if whole == 0 and tiles_h % count == 0 else 1


def wgmma_decode_ahead_bytes(token_tile: int) -> int:
    """The weight bytes a w8a8 wgmma gate/up block copies ahead of its first pass, all its ring's stages
    but one: by table slot before the lists land, which a slot nobody chose wastes (what this sizes)."""
    stages, ksub = WGMMA_DECODE_RING[token_tile]
    return (stages - 1) * WGMMA_DECODE_ROWS * 128 * ksub


# decode_wgmma_fp4.cu (WF_STAGES / WF_KSUB); three blocks fit an SM
WGMMA_FP4_DECODE_TOKEN_TILES = (8, 16)
WGMMA_FP4_DECODE_STAGES = 3
WGMMA_FP4_DECODE_KSUB = 2
WGMMA_FP4_DECODE_BLOCKS_PER_SM = 3  # at 8-row passes (16-row ones fit 2); the waves rules were tuned with it
WGMMA_DECODE_BLOCKS_PER_SM = 2
# decode_swapab_sm90.cu (SwapAbConfig<NT>): bf16 weights as the wgmma's M side by TMA, the
# tokens as its N side; token tiles, and per tile its ring stages, blocks an SM and consumer
# warpgroups (threads: 128 a consumer warpgroup + one producer warp)
SWAPAB_TOKEN_TILES = (8, 16, 32, 64, 128)
SWAPAB_STAGES = {8: 5, 16: 5, 32: 5, 64: 4, 128: 6}
SWAPAB_BLOCKS_PER_SM = {8: 2, 16: 2, 32: 2, 64: 2, 128: 1}
SWAPAB_ROWS = 128  # weight rows a block: two m64 tiles (down: 128 hidden columns)
SWAPAB_GATE_UP_COLUMNS = 64  # a gate/up block's 64 gate rows and the same 64 up rows
SWAPAB_BK = 64
SWAPAB_MAX_ROWS = 256  # the decode cap CUPYMOE_DECODE_KERNEL=swapab raises a bf16 layer's auto path to


SWAPAB_THREADS = 128 + 32  # one consumer warpgroup, one producer warp
# decode_swapab_gate_up_lora: the adapters' A rows stacked in 64-row tiles, a box an adapter on
# whole 128-byte swizzle atoms (8 rows), so ranks dividing 64 in multiples of 8
SWAPAB_LORA_RANKS = (8, 16, 32, 64)


def swapab_lora_rank(max_rank: int) -> bool:
    """Whether the swap-AB gate/up takes LoRA slots of this rank as more blocks (SWAPAB_LORA_RANKS)."""
    return max_rank in SWAPAB_LORA_RANKS


def swapab_lora_blocks(max_loras: int, max_rank: int) -> int:
    """LoRA blocks an expert of decode_swapab_gate_up_lora: 64 / max_rank adapters each."""
    return -(-max_loras * max_rank // 64)


def swapab_smem_bytes(token_tile: int) -> int:
    """decode_swapab_*<token_tile>: 1024 to align the ring, its stages (128 weight rows and the
    pass's rows, 64 bf16 of K each), two mbarriers a stage."""
    stages = SWAPAB_STAGES[token_tile]
    return 1024 + stages * (SWAPAB_ROWS + token_tile) * SWAPAB_BK * 2 + 16 * stages


# decode_swapab_fp8_sm90.cu (SwapAbFp8Config<NT>): fp8-block weights as w8a8, the bf16 scheme on
# e4m3 codes; a stage is one k128 step (128-byte rows, as the bf16 stage's 64 bf16), so the
# bf16 stage counts; NT stops at 64 (a step's fresh products and the promoted sums: 2 NT floats)
SWAPAB_FP8_TOKEN_TILES = (8, 16, 32, 64)
SWAPAB_FP8_STAGES = {8: 5, 16: 5, 32: 5, 64: 4}
SWAPAB_FP8_BLOCKS_PER_SM = 2
SWAPAB_FP8_BK = 128
SWAPAB_FORMATS = (WeightFormat.BF16, WeightFormat.FP8_BLOCK)  # the formats a swap-AB kernel serves (fp8: as w8a8)


def swapab_fp8_smem_bytes(token_tile: int) -> int:
    """decode_swapab_fp8_*<token_tile>: 1024 to align the ring, its stages (128 weight rows and the
    pass's rows, 128 codes of K each), each stage's scales (the tokens' and the two tiles'),
    two mbarriers a stage."""
    stages = SWAPAB_FP8_STAGES[token_tile]
    stage = (SWAPAB_ROWS + token_tile) * SWAPAB_FP8_BK + 4 * (token_tile + 2)
    return 1024 + stages * stage + 16 * stages

# decode.cu / decode_common.cuh
ROUTE_LISTS_MAX_ROWS = 8  # rows up to which routing and the lists are one launch (decode_route_lists)
ROUTE_LISTS_THREADS = 256  # one routing warp a row
LISTS_THREADS = 1024  # the one-block list builders' block
TOPK_LISTS_WARPS = 32  # decode_topk_lists' routing warps: its rows, one a warp
TOPK_LISTS_MAX_R = 256  # the widest router decode_topk_lists routes as topk_route does
REDUCE_THREADS = 256  # decode_reduce's block; a thread writes 4 columns a step
TOPK_WARPS = 4  # topk_route's warps a block, a row each
X_CODES_WARPS = 8  # x_codes_e4m3's warps a block, a 256-column unit of x each (topk.cu)
MAX_ROUTER_WIDTH = 4096  # routing.cuh: the widest router (E + zero experts) the top-k kernels take
MAX_TOPK = 64  # ... and the most experts a row
MAX_GROUPS = 32  # ... and the most expert groups
STATIC_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a launch may take without opting in
# rows a call: counts travel as int32 and grids are bounded, so a layer's max_tokens is capped
# at the largest N the index math was audited and tested at (tests/test_gpu_sizes.py)
MAX_TOKENS = 65536
MAX_GRID_Y = 65535  # CUDA's gridDim.y limit: the grouped GEMMs' M tiles run along y
# grouped.cu
SORT_BLOCK = 1024  # pairs a block of the multi-block sort
SMALL_SORT_PAIRS = 1024  # up to this many pairs the prefill path sorts in one block (decode_build_lists)
# the decode and atomic paths' one-block sort: up to LISTS_MAX_ROUNDS pairs a thread, one launch where
# the three-pass sort takes three (DECISIONS "The decode path's lists in one block past 1024 pairs")
LISTS_MAX_ROUNDS = 4
DECODE_SORT_PAIRS = LISTS_MAX_ROUNDS * LISTS_THREADS
SORT_WARPS = 32
GROUPED_BN = 128  # GG_BN
GROUPED_BM_MIN = 64  # the smallest M tile of the grouped GEMMs
ROUTER_MAX_SPLITS = 4  # gemm_common.cuh gemm_tile_at, router_logits_split: K splits of the router, a logits copy each (routing.cuh ROUTE_MAX_COPIES)
# grouped_sm90*.cu
SM90_BM, SM90_BK = 128, 64
GATHER_WARPS = 4  # the TMA kernel's gathering producer warps
TMA_A_BOX_ROWS = 64  # the TMA kernel's A boxes: one consumer warpgroup's rows
SM90_QUANT_FORMATS = (WeightFormat.NVFP4, WeightFormat.MXFP4)  # dequantized into its B tiles
SM90_FP8_TILE = (64, 256, 128, 4)  # grouped_gemm_sm90_fp8: BM, BN, BK bytes, stages
SM90_FP8_THREADS = 256
SM90_FP8_TMA_BN, SM90_FP8_TMA_BK = 256, 128  # grouped_gemm_sm90_fp8_tma, both forms: weight rows a tile, codes a stage row
# The H200 this was tuned on: 132 SMs x 32 warps of the decode kernels (<= 64 registers)
WARPS_PER_SM = 32


def router_split_copies(hidden_size: int) -> int:
    """K splits of router_logits_split (router_mma.cu), a logits copy each: a function of H alone,
    so a logit's order of additions never depends on N."""
    steps = -(-hidden_size // 32)
    return max(1, min(ROUTER_MAX_SPLITS, steps // ROUTER_SPLIT_STEPS))


def router_split(hidden_size: int) -> int:
    """Warps splitting H a router row (router.cu): 4 up to H = 4096, else 8. A function of H
    alone: the split fixes the order of a logit's sums (row invariance)."""
    return 4 if hidden_size <= 4096 else 8


@dataclass(frozen=True)
class Sm90Variant:
    """One configuration of the Hopper bf16 grouped GEMM (grouped_sm90.cu, or grouped_sm90_tma.cu with TMA)."""

    stages: int
    blocks_per_sm: int
    bn: int  # weight rows a tile (gate/up: half gate, half up)
    tma: bool = False  # TMA copies from a producer warp; bf16 gate/up and down only
    gather: bool = False  # (tma) gate/up's A rows gathered by the producer warps' cp.async, no xg
    wgs: int = 2  # (tma) consumer warpgroups, 64 rows each

    @property
    def bm(self) -> int:
        return 64 * self.wgs if self.tma else SM90_BM

    def threads(self, mode: int = 0) -> int:
        if not self.tma:
            return 256
        if self.wgs == 3:
            return 384  # three consumer warpgroups, one of whose threads issues the copies
        return 256 + 32 * (GATHER_WARPS if self.gather and mode == GemmMode.GATE_UP else 1)

    def serves(self, fmt: int, mode: int = 0) -> bool:
        """bf16 weights, or fp4 ones dequantized into 128-wide B tiles; TMA: bf16 gate/up and down."""
        if self.tma:
            return fmt == WeightFormat.BF16 and mode in (GemmMode.GATE_UP, GemmMode.DOWN)
        return fmt == WeightFormat.BF16 or (fmt in SM90_QUANT_FORMATS and self.bn == GROUPED_BN)

    def kernel(self, mode: int, fmt: int = 0) -> str:
        if self.tma:
            gather = 1 if self.gather and mode == GemmMode.GATE_UP else 0
            tail = f", {gather}, {self.wgs}" if self.wgs != 2 else f", {gather}" if gather else ""
            return f"grouped_gemm_sm90_tma<{int(mode)}, {self.stages}, {self.bn}, {self.blocks_per_sm}{tail}>"
        tail = f", {int(fmt)}" if fmt else ""
        return f"grouped_gemm_sm90<{int(mode)}, {self.stages}, {self.blocks_per_sm}, {self.bn}{tail}>"

    def kernel_lora(self, mode: int) -> str:
        """The LoRA stacked form of a TMA variant's kernel (grouped_gemm_sm90_tma_lora: the experts'
        deltas as extra K steps; forward_plan.lora_in_gemm), every template argument spelled."""
        assert self.tma, self
        gather = 1 if self.gather and mode == GemmMode.GATE_UP else 0
        return (f"grouped_gemm_sm90_tma_lora<{int(mode)}, {self.stages}, {self.bn}, {self.blocks_per_sm}, {gather}, "
                f"{self.wgs}>")

    def smem_bytes(self, fmt: int = 0) -> int:
        """Stages of A and B tiles, fp4's raw code stages, TMA's two mbarriers a stage, 1 KB to align."""
        raw = self.stages * self.bn * SM90_BK * 4 // 8 if fmt else 0
        bars = 16 * self.stages if self.tma else 0
        return self.stages * (self.bm + self.bn) * SM90_BK * 2 + raw + bars + 1024


def grouped_smem_bytes(bm: int, bk: int, stages: int, fmt: int = 0) -> int:
    """grouped_gemm<mode, bm, bk, stages, fmt>: its stages; quantized formats keep two bf16 B tiles plus code stages."""
    if fmt == WeightFormat.BF16:
        return stages * (bm + GROUPED_BN) * bk * 2
    return stages * bm * bk * 2 + 2 * GROUPED_BN * bk * 2 + stages * GROUPED_BN * bk * WeightFormat(fmt).bits // 8


def grouped_kernel(mode: int, bm: int, bk: int, stages: int, fmt: int = 0) -> tuple[str, int, int]:
    """(name expression, threads, dynamic shared memory) of grouped_gemm<mode, bm, bk, stages, fmt>."""
    return f"grouped_gemm<{int(mode)}, {bm}, {bk}, {stages}, {int(fmt)}>", 2 * bm, grouped_smem_bytes(bm, bk, stages, fmt)


# cuda/lora.cu lora_stack_t_seg<NP, BN> (CUPYMOE_LORA_STACK_SHRINK=segments): 64 rows of one adapter a
# slice against its NP R A rows (BN: NP R rounded up to one of these), four 64-column K stages
LORA_SEG_BNS = (16, 32, 64)
LORA_SEG_THREADS = 128
LORA_SEG_PIECE_ROWS = 768  # cuda/lora.cu LSS_PIECE: lora_stack_t_seg_experts' rows a block at most


def lora_seg_bn(np_: int, max_rank: int) -> int:
    """lora_stack_t_seg's BN for NP projections of max_rank ranks (the stacked form's ranks <= 32)."""
    bn = next((bn for bn in LORA_SEG_BNS if np_ * max_rank <= bn), None)
    if bn is None:
        raise ValueError(f"lora_stack_t_seg serves NP R <= {LORA_SEG_BNS[-1]}: NP={np_}, max_rank={max_rank}")
    return bn


def lora_seg_smem(bn: int) -> int:
    return 4 * (64 + bn) * 64 * 2


LORA_GROUPED_FORMATS = (WeightFormat.FP8_BLOCK,)  # grouped_gemm's formats with a stacked-form twin (w8a16)


def lora_grouped_kernel(kernel: str) -> str:
    """grouped_gemm<...> as its stacked form grouped_gemm_lora<...> (the same template arguments)."""
    assert kernel.startswith("grouped_gemm<"), kernel
    return "grouped_gemm_lora<" + kernel[len("grouped_gemm<"):]


@dataclass(frozen=True)
class Fp8TmaShape:
    """One form of the w8a8 TMA grouped GEMM (grouped_sm90_fp8_tma.cu's Fp8TmaShape<WGS>): `wgs`
    consumer warpgroups of 64 token rows beside the producer warpgroup, 256 weight rows a tile."""

    wgs: int

    @property
    def bm(self) -> int:
        return 64 * self.wgs

    @property
    def stages(self) -> int:  # two warpgroups: one block an SM; one: two blocks an SM
        return 4 if self.wgs == 2 else 2

    @property
    def threads(self) -> int:
        return 128 * (self.wgs + 1)

    def smem_bytes(self) -> int:
        """Stages of e4m3 A and B tiles, two mbarriers a stage, 1 KB to align."""
        return self.stages * (self.bm + SM90_FP8_TMA_BN) * SM90_FP8_TMA_BK + 16 * self.stages + 1024


# the w8a8 TMA GEMM's forms by their knob value (knobs.Sm90Fp8): "tma" 128 x 256 tiles, one block an
# SM; "tma64" 64 x 256 tiles, two blocks an SM (one block's epilogue under the other's wgmmas)
FP8_TMA_SHAPES = {"tma": Fp8TmaShape(2), "tma64": Fp8TmaShape(1)}
_TWO = FP8_TMA_SHAPES["tma"]
SM90_FP8_TMA_TILE = (_TWO.bm, SM90_FP8_TMA_BN, SM90_FP8_TMA_BK, _TWO.stages)  # the two-warpgroup form: BM, BN, BK, stages
SM90_FP8_TMA_THREADS = _TWO.threads  # two consumer warpgroups and the producer warpgroup


def sm90_fp8_kernel(mode: int, tma: bool = False, keep_activation: bool = False, wgs: int = 2) -> str:
    """The w8a8 grouped GEMM's name expression: grouped_gemm_sm90_fp8<mode> (grouped_sm90_fp8.cu; _tma:
    grouped_sm90_fp8_tma.cu); gate/up that also stores the bf16 activation, which no kernel reads
    (MoeLayer(keep_w8a8_activation=True): verify reads it), is <0, true>; the TMA kernel's one-warpgroup
    form (wgs 1) is <mode, keep, 1>."""
    assert not keep_activation or mode == GemmMode.GATE_UP, mode
    assert tma or wgs == 2, wgs
    if wgs != 2:
        return f"grouped_gemm_sm90_fp8_tma<{int(mode)}, {'true' if keep_activation else 'false'}, {wgs}>"
    return f"grouped_gemm_sm90_fp8{'_tma' if tma else ''}<{int(mode)}{', true' if keep_activation else ''}>"


def sm90_fp8_kernels(tma: bool) -> tuple[str, ...]:
    """Every instance of one w8a8 grouped GEMM (jit.MODULES): gate/up without and with the stored
    activation, down; the TMA kernel's in each of its forms."""
    forms = [shape.wgs for shape in FP8_TMA_SHAPES.values()] if tma else [2]
    return tuple(name for wgs in forms for name in (
        sm90_fp8_kernel(GemmMode.GATE_UP, tma, wgs=wgs), sm90_fp8_kernel(GemmMode.DOWN, tma, wgs=wgs),
        sm90_fp8_kernel(GemmMode.GATE_UP, tma, True, wgs=wgs)))


def sm90_fp8_tma_shape(expr: str) -> Fp8TmaShape:
    """The form of a grouped_gemm_sm90_fp8_tma name expression (a third template argument: its wgs)."""
    m = re.fullmatch(r"grouped_gemm_sm90_fp8_tma<\d+(?:, (?:true|false))?(?:, (\d))?>", expr)
    assert m, expr
    return Fp8TmaShape(int(m.group(1) or 2))


def sm90_fp8_smem_bytes() -> int:
    """grouped_gemm_sm90_fp8's stages of e4m3 A and B tiles, plus 1 KB to align them."""
    bm, bn, bk, st = SM90_FP8_TILE
    return st * (bm + bn) * bk + 1024


def sm90_fp8_tma_smem_bytes() -> int:
    """grouped_gemm_sm90_fp8_tma's (two warpgroups) stages of e4m3 A and B tiles, two mbarriers a stage, 1 KB to align."""
    return _TWO.smem_bytes()


def sort_place_smem_bytes(n_local: int) -> int:
    """sort_place: its block's first position of each local expert, each warp's 16-bit count of each."""
    return n_local * 4 + SORT_WARPS * n_local * 2


def expert_lists_smem_bytes(pairs: int, n_local: int) -> int:
    """build_expert_lists (decode_common.cuh), up to LISTS_MAX_ROUNDS x LISTS_THREADS pairs: starts, a
    16-bit count a slot for each 32 pairs."""
    counts = -(-pairs // 32) * n_local
    return (n_local + (counts + 1) // 2) * 4


def build_lists_smem_bytes(pairs: int, n_local: int, router_width: int) -> int:
    """decode_build_lists (decode.cu): the slot table (router_width ints), then build_expert_lists'."""
    return router_width * 4 + expert_lists_smem_bytes(pairs, n_local)


def topk_route_smem_bytes(router_width: int) -> int:
    """topk_route: each of its warps' scores and candidates (routing.cuh)."""
    return TOPK_WARPS * (2 * router_width + 64) * 4


# The router's LoRA t beside its logits (grouped_gemm_lora<MODE_ROUTER, ...>, topk_route_lora): the
# slots' fp32 A rows as three bf16 parts (each product exact, their sum fp32's precision), at most
# LORA_ROUTER_T_MAX_COLS columns in all (four more column tiles of the router GEMM)
LORA_ROUTER_PARTS = 3
LORA_ROUTER_T_MAX_COLS = 4 * GROUPED_BN
LORA_ROUTER_T_MAX_RANK = LORA_ROUTER_T_MAX_COLS // LORA_ROUTER_PARTS  # one slot of the largest rank


def lora_router_t_cols(max_loras: int, max_rank: int) -> int:
    """The router GEMM's LoRA t columns: every slot's ranks, in three parts."""
    return LORA_ROUTER_PARTS * max_loras * max_rank


LORA_RED = 8  # cuda/lora.cu LORA_RED: floats of the per-pair kernels' shared memory past t (the last-block flag)


def lora_pair_smem_bytes(max_rank: int, projections: int = 1) -> int:
    """A per-pair LoRA kernel's shared memory (cuda/lora.cu): t of `projections` projections' ranks
    (lora_gate_up_act's gate and up: 2), then LORA_RED floats."""
    return (projections * max_rank + LORA_RED) * 4


def topk_route_lora_smem_bytes(router_width: int, max_rank: int) -> int:
    """topk_route_lora: topk_route's, then each warp's row t (max_rank floats)."""
    return topk_route_smem_bytes(router_width) + TOPK_WARPS * max_rank * 4


def route_lists_smem_bytes(rows: int, k: int, router_width: int) -> int:
    """decode_route_lists: routing scratch, the lists and the slot table."""
    return (rows * (2 * router_width + 64) + 2 * rows * k + router_width) * 4


def route_lists_lora_smem_bytes(rows: int, k: int, router_width: int) -> int:
    """decode_route_lists_lora: decode_route_lists' (16-byte aligned), then the rows' logits with
    the LoRA delta added and their adapter ids."""
    return -(-route_lists_smem_bytes(rows, k, router_width) // 16) * 16 + rows * (router_width + 1) * 4


def topk_lists_smem_bytes(rows: int, k: int, n_local: int, router_width: int) -> int:
    """decode_topk_lists of `rows` rows: their warps' routing scratch, the slot table, then the lists'."""
    return (rows * (2 * router_width + 64) + router_width) * 4 + expert_lists_smem_bytes(rows * k, n_local)


def wgmma_decode_smem_bytes(token_tile: int, k_steps: int, weight_tiles: int = 1) -> int:
    """decode_wgmma_*_a8<token_tile> over `k_steps` k128 steps: 1024 to align the ring, its
    stages (weight rows and the pass's rows, 128 codes a k step), the weights' scales of every
    step (two m64 halves, or down's `weight_tiles` 128-row tiles, whichever is more) and each
    ring slot's rows' group scales (one a row and k step of the stage)."""
    stages, ksub = WGMMA_DECODE_RING[token_tile]
    stage = (WGMMA_DECODE_ROWS + token_tile) * 128 * ksub
    return 1024 + stages * stage + max(2, weight_tiles) * k_steps * 4 + stages * token_tile * ksub * 4


def wgmma_fp4_decode_smem_bytes(fmt: int, token_tile: int) -> int:
    """decode_wgmma_*_fp4<fmt, token_tile>: 1024 to align the ring, then its stages (the pass's
    bf16 rows, the weight rows' codes and their scale bytes: nvfp4 one a 16-code group, mxfp4 one a 32)."""
    group = 16 if fmt == WeightFormat.NVFP4 else 32
    ksub = WGMMA_FP4_DECODE_KSUB
    stage = ksub * (token_tile * 128 * 2 + WGMMA_DECODE_ROWS * 64 + WGMMA_DECODE_ROWS * 128 // group)
    return 1024 + WGMMA_FP4_DECODE_STAGES * stage


def max_tiles(num_tokens: int, k: int, n_local: int, has_shared: bool, bm: int = GROUPED_BM_MIN) -> int:
    """Upper bound of the grouped GEMMs' `bm`-row tiles (their grids' y extent): the routed runs
    (at most min(n_local, P) of P = N k rows) take at most (P + runs (bm - 1)) / bm, the shared
    expert's run of N rows its own ceil(N / bm)."""
    P = num_tokens * k
    runs = min(n_local, P)
    t = (P + runs * (bm - 1)) // bm
    if has_shared:
        t += -(-num_tokens // bm)
    return t


def token_limit(k: int, n_local: int, has_shared: bool) -> int:
    """The most rows a call may bring: MAX_TOKENS, or fewer where the grouped GEMMs' M tiles
    (max_tiles at the smallest tile height, their grid's y extent) would pass MAX_GRID_Y."""
    lo, hi = 0, MAX_TOKENS
    while lo < hi:  # max_tiles grows with N: bisect for the last N that fits
        mid = (lo + hi + 1) // 2
        if max_tiles(mid, k, n_local, has_shared) <= MAX_GRID_Y:
            lo = mid
        else:
            hi = mid - 1
    return lo
