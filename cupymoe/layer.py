"""MoeLayer: the stage launches of one MoE layer, on the caller's stream, by raw pointer.

`forward(input_ptr, num_tokens, output_ptr, stream, *, token_ids_ptr=0)` (DESIGN.md
section 5) only enqueues kernels on `stream`: no host sync, no allocation, no host-to-device
copy of per-step data, so a whole forward can be captured into a CUDA graph. All scratch
lives in the arena (fixed addresses); kernels were compiled and loaded at construction.
Every refusal happens before the first launch, so nothing is written when a call is
refused.

Paths (DESIGN.md section 3):
  decode  router -> top-k -> [pre-norm] -> expert lists -> gate/up -> down -> reduce; one
          launch per stage for all N rows, each selected expert's weights streamed once.
          Bit-reproducible.
  atomic  the same, but the routed down projections atomically add w * y into an fp32
          [N, H] accumulator that the reduce casts; not bit-reproducible (opt-in).
  prefill tensor-core router -> top-k -> [pre-norm] -> stable sort by expert -> grouped
          GEMMs (gate/up with the activation fused; down with the routing weight applied
          in fp32) -> unpermute + weighted reduce. mma.sync everywhere, wgmma on Hopper
          where the math decides (bf16 experts with I >= 768: the TMA kernel's 128 x 256
          tiles, whose gate/up reads the inputs gathered into sorted order by one more
          launch).
`auto` takes decode up to `decode_max_tokens` rows, prefill above; `row_invariant=True`
takes prefill at every N (a row's bits then never depend on N or the batch). With an
expert-parallel config and a communicator, the partial outputs are all-reduced last.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from . import formats, kernels, tma
from .arena import Arena, ArenaPlan, BufferSpec, plan_arena
from .config import MoeConfig, UnsupportedModelError
from .host_weights import HostWeights
from .profiling import StageTimer, dump_dir, profile_enabled, write_dumps
from .parallel import Communicator, check_communicator, owned_experts
from .weights import DeviceWeights, UnsupportedFormatError

log = logging.getLogger(__name__)

FP8_COMPUTE = ("auto", "w8a8", "w8a16")
PATHS = ("auto", "decode", "atomic", "prefill")
STAGES = ("route", "norm", "sort", "gate_up", "down", "reduce")
# auto: decode up to this many rows, grouped tensor-core GEMMs above: the measured
# crossover on the H200 lies between 8 and 16 rows (benchmarks/NOTES.md). fp4 experts' decode
# kernels run on tensor cores (cuda/decode_mma.cu) and beat the grouped path up to 256 rows
# on both measured shapes (nvfp4 at 256: qwen3-30b-a3b 502 vs 536 us, deepseek-v3 4436 vs
# 5146; NOTES.md v14); fp8-block experts' (tensor cores too) up to 64 rows (N = 64:
# qwen3-30b-a3b 197.5 vs w8a8's 301.2 us, deepseek-v3 1754 vs 1730; at 128 deepseek-v3 2711
# vs 1962; NOTES.md v20)
DEFAULT_DECODE_MAX_TOKENS = 8
DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT = {"nvfp4": 256, "mxfp4": 256, "fp8_block": 64}
# the atomic path measured no faster than decode; it serves the decode range at most
DEFAULT_ATOMIC_MAX_TOKENS = 8
# w8a8 decode (fp8-block experts on sm_90a): decode_wgmma_a8.cu's kernels (weights through
# a shared-memory ring, wgmma e4m3; two blocks an SM) where their gate/up grid holds at least
# this many waves of blocks, the register-direct mma.sync ones of decode_mma.cu (which split
# K to fill the GPU) below (kernels.w8a8_decode_mode). Measured (benchmarks/NOTES.md v31, µs,
# mma -> wgmma): qwen3-30b-a3b N = 4 (1.5 waves) 55.0 -> 60.9, N = 8 (2.9) 97.0 -> 91.0;
# deepseek-v3 N = 1 (1.0) 105.9 -> 108.3, N = 4 (3.9) 350.5 -> 326.5; again in v43 (the
# register-direct down copying ahead): qwen3-30b-a3b N = 4 52.6 -> 57.1, deepseek-v3 N = 1 103.4
# -> 103.1, N = 2 (512 blocks, 1.94 waves: under the 2.0 this was) 194.5-195.1 -> 187.2
WGMMA_DECODE_MIN_WAVES = 1.9
# fp4 decode (sm_90a): decode_wgmma_fp4.cu's kernels (codes through a shared-memory ring,
# dequantized into wgmma's A operand; three blocks an SM) where their gate/up grid holds at
# least this much of a wave of blocks, decode_mma.cu's fp4 kernels below (kernels.fp4_decode_mode).
# Measured (benchmarks/NOTES.md v33, µs, nvfp4 / mxfp4, mma -> wgmma): deepseek-v3 N = 1 (288
# blocks, 0.73 waves) 97.1 -> 108.9 / 88.2 -> 96.7, qwen3-30b-a3b N = 2 (192) 35.0 -> 39.8 /
# 34.4 -> 37.5; qwen3-30b-a3b N = 4 (348, 0.88) 56.7 -> 52.7 / 53.1 -> 50.0, deepseek-v3 N = 2
# (512) 190.4 -> 183.3 / 175.5 -> 158.0, and from 8 rows on 3-27 % less time
WGMMA_FP4_DECODE_MIN_WAVES = 0.8
WGMMA_FP4_DECODE_BLOCKS_PER_SM = 3
# decode_wgmma_down_fp4 takes two 128-row tiles a block, one run of its ring through both,
# where the experts' I is at most this many of its stages (256 codes) and the halved grid over
# the experts N rows are expected to choose still fills a wave (layer._fp4_down_tiles). A
# block of qwen3-30b-a3b's I = 768 is three stages, its whole ring: the copies of one tile
# then wait for nothing of the next. Measured (NOTES.md v42, µs, nvfp4 / mxfp4, one tile ->
# two): qwen3-30b-a3b N = 64 135.4-135.9 -> 133.8-134.1 / 132.1-132.2 -> 128.8-129.2, N = 32
# 120.1 -> 119.1-119.3 / 116.4-117.0 -> 115.3-115.9, N = 8 -0.1-0.4; N = 4 (0.57 of a wave of
# two-tile blocks) +0.5-0.9; deepseek-v3 (I = 2048, 8 stages) N = 2 / 8 +3-6, N = 64 -0.5 %.
FP4_DOWN_TILES_MAX_STAGES = 4
# ... and their gate/up's grid by table slot, each block's first weight stages copied before
# it waits for the lists, where the blocks of experts nobody chose are expected to copy at
# most this many bytes for nothing (n_local (1 - k/E)^N experts, each its gate/up blocks'
# first stages: gate_up_ahead_waste). Measured (NOTES.md v32, µs, by active expert -> by
# slot): qwen3-30b-a3b N = 32 157.5-157.9 -> 152.2-152.5 (12 MiB expected for nothing),
# N = 64 181.9-182.3 -> 175.1-175.3 (1.5 MiB); deepseek-v3 N = 64 1449.7-1450.0 -> 1499.5-1499.8
# (67 MiB)
WGMMA_GATE_UP_AHEAD_MAX_WASTE = 16 << 20


def gate_up_ahead_waste(n_local: int, num_experts: int, k: int, num_tokens: int, i_max: int) -> float:
    """Bytes the wgmma gate/up's blocks by slot are expected to copy for nothing at
    `num_tokens` rows: the experts nobody chose (each with chance (1 - k/E)^N, rows choosing
    independently), each its gate/up blocks' first WGMMA_DECODE_STAGES - 1 stages of weights."""
    E = max(num_experts, 1)
    idle = n_local * (1.0 - min(k, E) / E) ** num_tokens
    ahead = (kernels.WGMMA_DECODE_STAGES - 1) * kernels.WGMMA_DECODE_ROWS * 128 * kernels.WGMMA_DECODE_KSUB
    return idle * -(-i_max // kernels.WGMMA_DECODE_GATE_UP_COLUMNS) * ahead


from .errors import MoeCallError, PathUnavailableError  # noqa: F401 (re-exported)


def _u64(v: int) -> np.uint64:
    return np.uint64(v)


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _f32(v: float) -> np.float32:
    return np.float32(v)


def _row_tile(rows: float, tiles: tuple[int, ...]) -> int:
    """Smallest tile holding `rows` expected rows, capped at the largest variant."""
    for t in tiles:
        if t >= rows:
            return t
    return tiles[-1]


GROUPED_BM = 64  # the smallest M-tile height of the grouped GEMMs (kernels.GROUPED_CONFIGS)
# the prefill router's K splits at most (gemm_common.cuh gemm_tile_at): each writes its own
# logits copy, which topk_route sums
ROUTER_MAX_SPLITS = 4
# the decode router runs on tensor cores (router_mma.cu; CUPYMOE_DECODE_ROUTER) from this
# many multiply-adds (R N H): below it the CUDA-core router, which reads x once per two router
# columns, is as fast or faster (NOTES.md v36: deepseek-v3 fp8 N = 16 / 64 -10 / -30 us,
# qwen3-30b-a3b N = 64 -0.5; N = 1-4 and qwen3-30b-a3b N = 16 0.5-2 us slower)
DECODE_ROUTER_MMA_MIN_MACS = 1 << 24
SORT_BLOCK = 1024  # pairs per block of the multi-block sort (cuda/grouped.cu SORT_THREADS)
SMALL_SORT_PAIRS = 1024  # up to this many pairs one block sorts them (decode_build_lists)
ROUTE_LISTS_MAX_ROWS = 8  # decode rows up to which routing and the lists are one launch (decode_route_lists)
ROUTE_LISTS_THREADS = 256  # decode.cu: its block (one routing warp a row, so >= 32 ROUTE_LISTS_MAX_ROWS)
LISTS_THREADS = 1024  # decode_common.cuh: the one-block list builders' block
TOPK_LISTS_WARPS = 16  # decode.cu decode_topk_lists: its routing warps (of LISTS_THREADS)
TOPK_LISTS_MAX_R = 256  # ... and the widest router it routes as topk_route does
# w8a8 on the decode path: x's e4m3 codes come from decode_route_lists' idle warps (one per
# row not routed, beside the routing) where each takes at most this many 256-column units,
# else from the router, whose warps share them (a unit there adds ~1 us to N = 1: NOTES.md v29)
ROUTE_LISTS_QUANT_UNITS = 4


def route_lists_quantizes(num_tokens: int, hidden_size: int) -> bool:
    """Whether decode_route_lists quantizes x (w8a8) for `num_tokens` rows, rather than the router."""
    idle = ROUTE_LISTS_THREADS // 32 - num_tokens
    return idle > 0 and num_tokens * -(-hidden_size // 256) <= ROUTE_LISTS_QUANT_UNITS * idle
REDUCE_THREADS = 256  # decode.cu decode_reduce's block; a thread writes 4 columns a step


def max_tiles(num_tokens: int, k: int, n_local: int, has_shared: bool, bm: int = GROUPED_BM) -> int:
    """Upper bound of the grouped GEMMs' `bm`-row M-tiles (the grids' y extent): a run of r
    rows takes ceil(r / bm) <= (r + bm - 1) / bm tiles, so the routed runs (at most
    min(n_local, P) of them, P rows in all) take at most (P + runs (bm - 1)) / bm; the shared
    expert's run of N rows its own ceil(N / bm). Each bound block past the sort's tile count
    still starts and exits: a bound counted in 64-row tiles left two thirds of the blocks of
    qwen3-next-80b's 192-row down GEMM empty at N = 16384 (NOTES.md v27)."""
    P = num_tokens * k
    runs = min(n_local, P)
    t = (P + runs * (bm - 1)) // bm
    if has_shared:
        t += -(-num_tokens // bm)
    return t


# Average rows per local expert from which the grouped GEMMs take the "math" configuration
# (128-row tiles) over "stream" (64-row tiles, a deeper K pipeline). mma.sync: 96 (NOTES.md
# v6). Hopper's twin wgmma kernel: 40 (v11: from 64 rows up 128-row tiles win, qwen3-30b
# N = 1024 544 -> 483 us, qwen3-next-80b N = 4096 1828 -> 1261; at 32 rows the shapes
# disagree, deepseek-v3 5661 -> 5191 but gpt-oss-120b 1748 -> 1932; below, stream wins).
MATH_ROWS_PER_EXPERT = {"mma": 96, "wgmma": 40}


def math_rows_per_expert(kernel: str) -> int:
    """MATH_ROWS_PER_EXPERT[kernel] ("mma" or "wgmma"); CUPYMOE_MATH_ROWS overrides both
    for measurements."""
    return kernels.positive_int_env("CUPYMOE_MATH_ROWS") or MATH_ROWS_PER_EXPERT[kernel]


RESIDENT_WARPS = 132 * 32  # H200: 132 SMs x 32 warps of the decode kernels (<= 64 registers)


def _cols_per_warp(warp_columns: int, rt: int, variants) -> int:
    """Fewest columns per warp that cover `warp_columns` in about one wave of resident warps:
    a partial second wave would leave most SMs idle at its end."""
    allowed = [c for r, c in variants if r == rt]
    for c in allowed:
        if warp_columns / c <= RESIDENT_WARPS:
            return c
    return allowed[-1]


def plan_layer_arena(cfg: MoeConfig, max_tokens: int, n_local: int, i_max: int,
                     decode_max_tokens: int, w8a8: bool = False, w8a8_shared_x: bool = False,
                     gathered_inputs: bool = False) -> ArenaPlan:
    """The layer's buffers, their live stages and the ONE alias table. `w8a8`: the e4m3
    copies of the expert input and of the activation, with their scales per 128 columns;
    `w8a8_shared_x`: also x's, for an fp8 shared expert behind a pre-expert norm;
    `gathered_inputs`: xg, the expert inputs in sorted order (the TMA GEMM's gate/up A)."""
    T, k, H, R = max_tokens, cfg.num_experts_per_tok, cfg.hidden_size, cfg.router_width
    sh = 1 if cfg.has_shared_expert else 0
    P = T * k + sh * T  # expert positions: every routed pair, plus one shared row per token
    Td = min(T, decode_max_tokens)
    Pd = Td * k + sh * Td
    nblk = -(-T * k // SORT_BLOCK)
    buffers = [
        BufferSpec("err", 4, "route", "reduce"),  # sticky error bits, read by check_errors()
        BufferSpec("logits", T * R * 4 * ROUTER_MAX_SPLITS, "route", "route"),  # a split router's copies
        BufferSpec("topk_ids", T * k * 4, "route", "reduce"),
        BufferSpec("topk_w", T * k * 4, "route", "reduce"),
        BufferSpec("xe", T * H * 2 if cfg.pre_expert_norm else 0, "norm", "reduce"),
        BufferSpec("block_counts", nblk * n_local * 4, "sort", "sort"),  # multi-block sort
        BufferSpec("num_active", 4, "sort", "down"),
        BufferSpec("active_slot", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("active_start", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("active_len", (n_local + 1) * 4, "sort", "down"),
        BufferSpec("num_tiles", 4, "sort", "down"),  # grouped path: M-tiles
        BufferSpec("tile_info", max_tiles(T, k, n_local, bool(sh)) * 16, "sort", "down"),
        # down's tiles where their height differs from gate/up's (built by the sort too)
        BufferSpec("num_tiles_down", 4, "sort", "down"),
        BufferSpec("tile_info_down", max_tiles(T, k, n_local, bool(sh)) * 16, "sort", "down"),
        BufferSpec("sorted_row", P * 4, "sort", "gate_up"),
        BufferSpec("sorted_pair", P * 4, "sort", "down"),
        BufferSpec("pair_pos", (T * k + T) * 4, "sort", "reduce"),
        BufferSpec("slot_active", (n_local + 1) * 4, "sort", "gate_up"),  # decode lists: slot -> active index
        BufferSpec("xg", P * H * 2 if gathered_inputs else 0, "gate_up", "gate_up"),
        BufferSpec("act", P * i_max * 2, "gate_up", "down"),
        BufferSpec("y", Pd * H * 4, "down", "reduce"),  # decode: fp32 expert outputs
        BufferSpec("yw", P * H * 2, "down", "reduce"),  # grouped: weighted bf16 expert outputs
        BufferSpec("acc", Td * H * 4, "sort", "reduce"),  # atomic path: zeroed in 'sort'
        # w8a8 (fp8 experts on sm_90a, every path): e4m3 codes and per-128-column scales (x's
        # made in the routing stage, the norm's output's by the norm, the activation's by the
        # gate/up GEMM's epilogue or, on the decode path, by the last block of its group:
        # act_tickets counts them, and is zeros between forwards)
        BufferSpec("qx", T * H if w8a8 else 0, "route", "gate_up"),
        BufferSpec("sx", T * -(-H // 128) * 4 if w8a8 else 0, "route", "gate_up"),
        BufferSpec("qx_shared", T * H if w8a8_shared_x else 0, "route", "gate_up"),
        BufferSpec("sx_shared", T * -(-H // 128) * 4 if w8a8_shared_x else 0, "route", "gate_up"),
        BufferSpec("qact", P * i_max if w8a8 else 0, "gate_up", "down"),
        BufferSpec("sact", P * -(-i_max // 128) * 4 if w8a8 else 0, "gate_up", "down"),
        BufferSpec("act_tickets", (n_local + 1) * -(-i_max // 128) * 4 if w8a8 else 0, "gate_up", "gate_up"),
    ]
    # logits die once top-k has read them; act is born at gate_up. xg dies in gate_up, yw
    # is born in down.
    aliases = [("logits", "act"), ("xg", "yw")]
    return plan_arena(STAGES, buffers, aliases)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What MoeLayer.__init__ decides from the config, the weights' formats and the GPU's
    arch alone, before anything is uploaded: shared with `python -m cupymoe inspect`, which
    reports the scratch a layer would allocate on a GPU it does not have.

    decode_max_tokens: rows the decode and atomic paths serve (their scratch is sized for it);
    format_codes: the expert weight formats present (routed, then a shared expert of another
    format); fp8_compute: "w8a8" / "w8a16" for fp8-block experts, else None; sm90: the Hopper
    GEMM variant of gate/up (0), down (1) and the router (2); gathers_rows: gate/up reads its
    inputs from xg in sorted order; math_rows: rows per expert from which the grouped path
    takes its math configuration; w8a8_shared_x: x gets its own e4m3 copy (an fp8 shared
    expert behind a pre-expert norm)."""

    decode_max_tokens: int
    format_codes: tuple
    fp8_compute: Optional[str]
    sm90: Mapping[int, Any]
    gathers_rows: bool
    math_rows: int
    w8a8_shared_x: bool

    @property
    def tma(self) -> bool:
        """Whether gate/up or down runs on the TMA kernel (the layer uploads tensor maps)."""
        return bool(self.sm90[0].tma or self.sm90[1].tma)

    def arena(self, cfg: MoeConfig, max_tokens: int, n_local: int, i_max: int) -> ArenaPlan:
        """The layer's scratch: plan_layer_arena with this plan's choices."""
        return plan_layer_arena(cfg, max_tokens, n_local, i_max, self.decode_max_tokens,
                                self.fp8_compute == "w8a8", self.w8a8_shared_x, self.gathers_rows)


def plan_layer(cfg: MoeConfig, routed_format: str, shared_format: Optional[str], arch: str, *,
               row_invariant: bool = False, fp8_compute: str = "auto",
               decode_max_tokens: Optional[int] = None) -> LayerPlan:
    """MoeLayer's choices for experts of `routed_format` (and a shared expert of
    `shared_format`, None without one) on a GPU compiled for `arch` (kernels.library().arch,
    e.g. "sm_90a"). Reads the measurement knobs (CUPYMOE_SM90_VARIANT, CUPYMOE_MATH_ROWS) as
    the layer does. Raises UnsupportedFormatError for an fp8_compute the layer cannot run."""
    if fp8_compute not in FP8_COMPUTE:
        raise ValueError(f"fp8_compute={fp8_compute!r}: must be one of {FP8_COMPUTE}")
    if decode_max_tokens is None:
        decode_max_tokens = DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT.get(routed_format, DEFAULT_DECODE_MAX_TOKENS)
    fmts = [routed_format] + ([shared_format] if shared_format else [])
    format_codes = tuple(dict.fromkeys(kernels.FORMAT_CODES[f] for f in fmts))
    # fp8-block experts: w8a8 (e4m3 tensor cores) where it runs, unless w8a16 is asked for
    if kernels.FORMAT_CODES["fp8_block"] not in format_codes:
        if fp8_compute == "w8a8":
            raise UnsupportedFormatError("fp8_compute='w8a8' needs fp8_block experts; this layer's are "
                                         f"{routed_format} (shared: {shared_format})")
        fp8 = None
    elif arch != "sm_90a":
        if fp8_compute == "w8a8":
            raise UnsupportedFormatError(f"fp8_compute='w8a8' needs sm_90a (wgmma e4m3); this device is "
                                         f"{arch}: use fp8_compute='w8a16'")
        fp8 = "w8a16"
    else:
        fp8 = "w8a16" if fp8_compute == "w8a16" else "w8a8"
    # the Hopper GEMM's configuration and the rows per expert from which the grouped GEMMs
    # take 128-row tiles: resolved once here, not on every forward. The routed experts' math
    # config runs on wgmma: bf16, and fp4 since v15 (at 64 rows per expert 128-row tiles win
    # for fp4 too: qwen3-30b-a3b N = 1024 720 -> 660 us, deepseek-v3 N = 2048 11574 -> 10415;
    # NOTES.md v15)
    sm90 = {m: kernels.SM90_VARIANTS[kernels.sm90_variant_for(cfg.moe_intermediate_size, m)] for m in (0, 1)}
    hopper = arch == "sm_90a" and not row_invariant
    # the TMA kernel serves bf16 experts' gate/up and down; a layer it cannot serve
    # (quantized experts) takes the cp.async kernel of twin's tiles; the router's GEMM
    # (mode 2) keeps the cp.async kernel
    twin = kernels.SM90_VARIANTS["twin"]
    tma_ok = hopper and all(kernels.SM90_VARIANTS["tma"].serves(f, 0) for f in format_codes)
    sm90 = {m: twin if v.tma and not tma_ok else v for m, v in sm90.items()}
    sm90[2] = twin if sm90[0].tma else sm90[0]
    wgmma = hopper and sm90[0].serves(kernels.FORMAT_CODES[routed_format])
    return LayerPlan(
        decode_max_tokens=max(1, int(decode_max_tokens)),
        format_codes=format_codes,
        fp8_compute=fp8,
        sm90=sm90,
        # gate/up on TMA reads its inputs in sorted order from xg (gather_rows), unless its
        # producer gathers the rows itself
        gathers_rows=bool(sm90[0].tma and not sm90[0].gather),
        math_rows=math_rows_per_expert("wgmma" if wgmma else "mma"),
        # an fp8 shared expert reads x, not the normed xe: then x needs its own e4m3 copy
        w8a8_shared_x=fp8 == "w8a8" and shared_format == "fp8_block" and cfg.pre_expert_norm,
    )


class _StreamHandle:
    """A raw cudaStream_t seen through the CUDA stream protocol (`__cuda_stream__`)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


class MoeLayer:
    """One MoE layer on one GPU. See DESIGN.md section 5 for the calling convention."""

    def __init__(self, cfg: MoeConfig, host_weights: HostWeights, *, max_tokens: int,
                 device: Optional[int] = None, path: str = "auto", row_invariant: bool = False,
                 atomic_max_tokens: int = DEFAULT_ATOMIC_MAX_TOKENS,
                 decode_max_tokens: Optional[int] = None,
                 comm: Optional[Communicator] = None, expert_owner: Optional[Sequence[int]] = None,
                 fp8_compute: str = "auto"):
        """Options: `path`, `row_invariant`, `decode_max_tokens` (default: the measured
        crossover for the routed experts' format, DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT, else
        DEFAULT_DECODE_MAX_TOKENS), `atomic_max_tokens` (module docstring); `comm` sums the expert-parallel partials (cupymoe.parallel; without it an
        EP layer writes its rank's partial); `expert_owner[e]` = the rank computing expert e
        (default: contiguous blocks of E / ep_world_size). `fp8_compute` for fp8-block
        experts on every path: "w8a8" (sm_90a: activations quantized per row and 128 columns,
        e4m3 tensor cores), "w8a16" (weights dequantized to bf16 in registers, any GPU),
        "auto" (w8a8 where it runs)."""
        import cupy

        if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens!r}: must be a positive integer")
        if path not in PATHS:
            raise ValueError(f"path={path!r}: must be one of {PATHS}")
        if fp8_compute not in FP8_COMPUTE:  # before anything is uploaded
            raise ValueError(f"fp8_compute={fp8_compute!r}: must be one of {FP8_COMPUTE}")
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        for name, v in (("hidden_size", H), ("moe_intermediate_size", I),
                        ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
            if v % 8:
                raise ValueError(f"MoeConfig.{name}={v}: the kernels read 16-byte vectors, so it must be a multiple of 8")
        if cfg.n_group > 32:
            raise ValueError(f"MoeConfig.n_group={cfg.n_group}: the top-k kernel handles at most 32 groups")
        if cfg.num_experts_per_tok > 64 or cfg.router_width > 4096:
            raise ValueError(f"k={cfg.num_experts_per_tok}, R={cfg.router_width}: the top-k kernel serves k <= 64, R <= 4096")

        self.cfg = cfg
        self.max_tokens = int(max_tokens)
        self.device_id = cupy.cuda.runtime.getDevice() if device is None else int(device)
        self.default_path = path
        self.row_invariant = bool(row_invariant)
        if decode_max_tokens is None:
            decode_max_tokens = DEFAULT_DECODE_MAX_TOKENS_BY_FORMAT.get(formats.weight_format(host_weights.down),
                                                                        DEFAULT_DECODE_MAX_TOKENS)
        self.decode_max_tokens = max(1, int(decode_max_tokens))
        self.atomic_max_tokens = min(int(atomic_max_tokens), self.decode_max_tokens)
        if path in ("decode", "atomic") and row_invariant:
            raise PathUnavailableError(f"path={path!r} with row_invariant=True: row-invariant layers run the "
                                       "grouped path at every N; use path='auto' or 'prefill'")

        self.comm = comm
        if comm is not None:
            check_communicator(cfg, comm)
        owned = owned_experts(cfg, expert_owner)
        with cupy.cuda.Device(self.device_id):
            self.lib = kernels.library(self.device_id)
            sort_smem = kernels.sort_place_smem_bytes(len(owned))
            if sort_smem > self.lib.max_smem:
                raise UnsupportedModelError(
                    f"{len(owned)} routed experts on one GPU: the grouped path's sort needs {sort_smem} bytes of "
                    f"shared memory a block, this GPU allows {self.lib.max_smem}; spread the experts over more "
                    "ranks (ep_world_size)")
            self._sm_count = cupy.cuda.Device(self.device_id).attributes["MultiProcessorCount"]
            # fp4 and fp8 weights on the decode path: tensor cores (decode_mma.cu), or the
            # CUDA-core streams of decode.cu (CUPYMOE_FP4_DECODE=cores, CUPYMOE_FP8_DECODE=cores,
            # for measurements); the knobs are read before anything is uploaded
            fp4_mode, fp8_mode = kernels.fp4_decode_mode(), kernels.fp8_decode_mode()
            self._mma_blocks_per_sm = kernels.mma_decode_blocks_per_sm()
            self._mma_down_pairs = kernels.mma_decode_down_pairs()
            self._fp4_down_tiles_forced = kernels.fp4_down_tiles()
            self._w8a8_decode_mode = kernels.w8a8_decode_mode()
            self._topk_lists = kernels.topk_lists_mode()
            # the decode router: router_mma.cu's tensor-core kernel needs clusters (sm_90a)
            self._decode_router = kernels.decode_router_mode() if self.lib.arch == "sm_90a" else "cores"
            # the decode chain's kernels by programmatic dependent launch (sm_90+): each may
            # start under the previous one's last blocks (kernels.launch_pdl)
            self._pdl = kernels.pdl_mode() and kernels.parse_arch(self.lib.arch)[0] >= 90
            self.weights = DeviceWeights(cfg, host_weights, self.device_id, owned)
            self._mma_decode_formats = (kernels.fp4_decode_mma_formats(fp4_mode, self.weights.mxfp4_scale_bytes)
                                        + ((kernels.FORMAT_CODES["fp8_block"],) if fp8_mode == "mma" else ()))
            # fp4 experts on decode_wgmma_fp4.cu (sm_90a): its k steps are whole 128-code steps,
            # so every K it reads (H, and each fp4 expert's I) must be a multiple of 128
            fp4_ks = [cfg.hidden_size] + [i for f, i in ((self.weights.format, cfg.moe_intermediate_size),
                                                         (self.weights.shared_format,
                                                          cfg.shared_expert_intermediate_size))
                                          if f in kernels.FP4_DECODE_FORMATS]
            self._fp4_decode_mode = fp4_mode
            self._fp4_wgmma_ok = self.lib.arch == "sm_90a" and all(K % 128 == 0 for K in fp4_ks)
            # the choices that need only the config, the formats and the arch (LayerPlan;
            # `python -m cupymoe inspect` makes the same ones without a GPU)
            plan = plan_layer(cfg, self.weights.format, self.weights.shared_format, self.lib.arch,
                              row_invariant=self.row_invariant, fp8_compute=fp8_compute,
                              decode_max_tokens=self.decode_max_tokens)
            self._format_codes = plan.format_codes  # the expert kernels run once per format
            self.fp8_compute = plan.fp8_compute
            self._sm90 = dict(plan.sm90)  # gate/up's variant, down's, the router's
            self._tma = plan.tma  # the layer has tensor maps
            self._gathers_rows = plan.gathers_rows
            self._math_rows = plan.math_rows
            self._w8a8_shared_x = plan.w8a8_shared_x
            w8a8 = self.fp8_compute == "w8a8"
            self.arena = Arena(plan.arena(cfg, self.max_tokens, self.weights.n_local, self.weights.i_max),
                               self.device_id)
            self._tma_maps = self._upload_tma_maps() if self._tma else None
            cupy.cuda.runtime.memset(self.arena.ptr("err"), 0, 4)
            if w8a8:  # the decode gate/up's tickets start at zero; its last blocks reset them
                cupy.cuda.runtime.memset(self.arena.ptr("act_tickets"), 0, self.arena.nbytes("act_tickets"))
            # the fp8 experts' w8a8 arguments (both paths' kernels), fixed with the arena: the
            # inputs' codes and scales (x's own for a shared expert behind a norm), the
            # activation's; empty for a layer that does not run w8a8
            A = self.arena
            qx_shared = ("qx_shared", "sx_shared") if self._w8a8_shared_x else ("qx", "sx")
            self._w8a8_args = tuple(_u64(A.ptr(n)) for n in ("qx", "sx", *qx_shared, "qact", "sact")) if w8a8 else ()
            self._ctx = cupy.cuda.driver.ctxGetCurrent()
            # The weights (and the fp4 words' repack kernel), their tables and that memset
            # went through the legacy default stream (a pageable upload may even return
            # before its DMA lands); callers launch on their own streams, often non-blocking
            # ones that never wait for it: a first forward could read half-written tables
            # (seen on the H200 as a misaligned address in the bench, gone under
            # CUDA_LAUNCH_BLOCKING). Finish them here.
            cupy.cuda.runtime.deviceSynchronize()
        self._streams: dict[int, Any] = {}
        log.info("MoeLayer ready on device %d (%s): %d local experts, weights %.1f MB, arena %.1f MB",
                 self.device_id, self.lib.arch, self.weights.n_local, self.weights.nbytes / 1e6,
                 self.arena.total_bytes / 1e6)

    # --- constructors ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config_dict: Mapping[str, Any], tensors: Mapping[str, Any], prefix: str, *,
                max_tokens: int, **options) -> "MoeLayer":
        """Build from a config.json dict and a mapping of hub tensor names (numpy, torch, CuPy)."""
        from .checkpoint import load_layer_from_tensors

        cfg, hw = load_layer_from_tensors(config_dict, tensors, prefix)
        return cls(cfg, hw, max_tokens=max_tokens, **options)

    @classmethod
    def from_pretrained(cls, checkpoint_dir, layer_idx: int, *, max_tokens: int, **options) -> "MoeLayer":
        """Build from a checkpoint directory in hub naming (config.json + safetensors)."""
        from .checkpoint import load_layer

        cfg, hw = load_layer(checkpoint_dir, layer_idx)
        return cls(cfg, hw, max_tokens=max_tokens, **options)

    def _upload_tma_maps(self):
        """The TMA kernel's tensor maps (cupymoe/tma.py), in device memory: A of gate/up (xg)
        and of down (act, through the routed and the shared expert's K), the stacked routed
        weights and the shared expert's."""
        import cupy

        cfg, W, A = self.cfg, self.weights, self.arena
        H, I, n = cfg.hidden_size, cfg.moe_intermediate_size, W.n_local
        bm, bn, bn_down = kernels.TMA_A_BOX_ROWS, self._sm90[0].bn, self._sm90[1].bn
        gate_up, down = self._sm90[0].tma, self._sm90[1].tma
        # the A maps span their arena buffers exactly: TMA never reads past them
        xg_rows, act_rows = A.nbytes("xg") // (2 * H), A.nbytes("act") // (2 * W.i_max)  # xg: 0 unless gathered
        ptrs = {p: W.tables[p].get() for p in ("gate", "up", "down")}  # per-slot weight addresses
        Is = cfg.shared_expert_intermediate_size if cfg.has_shared_expert else 0

        def routed(p, rows, cols, box, used):
            return (tma.Matrix2D(int(ptrs[p][0]), n * rows, cols), box) if n and used else None

        def shared(p, rows, cols, box, used):
            return (tma.Matrix2D(int(ptrs[p][n]), rows, cols), box) if Is and used else None

        # the maps of the GEMMs that run on the TMA kernel (gate/up, down, or both)
        table = tma.encode_table([
            (tma.Matrix2D(A.ptr("xg"), xg_rows, H), bm) if self._gathers_rows else None,
            (tma.Matrix2D(A.ptr("act"), act_rows, I, W.i_max), bm) if down else None,
            (tma.Matrix2D(A.ptr("act"), act_rows, Is, W.i_max), bm) if Is and down else None,
            routed("gate", I, H, bn // 2, gate_up), routed("up", I, H, bn // 2, gate_up),
            routed("down", H, I, bn_down, down),
            shared("gate", Is, H, bn // 2, gate_up), shared("up", Is, H, bn // 2, gate_up),
            shared("down", H, Is, bn_down, down),
            # down's output, stored by TMA from the staged tile (64-row, 64-column boxes)
            (tma.Matrix2D(A.ptr("yw"), A.nbytes("yw") // (2 * H), H), bm) if down else None,
        ])
        return cupy.asarray(np.frombuffer(table, np.uint8))

    # --- dispatch ------------------------------------------------------------------------
    def _check_path(self, path: str, num_tokens: int, cfg: MoeConfig) -> None:
        if self.row_invariant and path != "prefill":
            raise PathUnavailableError(
                f"path={path!r} with row_invariant=True: row-invariant layers run the grouped path at every N, "
                "so a row's bits do not depend on N or on the path; use path='auto' or 'prefill'"
            )
        if path in ("decode", "atomic") and num_tokens > self.decode_max_tokens:
            raise PathUnavailableError(
                f"path={path!r} serves num_tokens <= decode_max_tokens={self.decode_max_tokens}, got {num_tokens} "
                "(its scratch is sized for that; raise decode_max_tokens at construction)"
            )
        if path == "atomic":
            if self.row_invariant:
                raise PathUnavailableError("path='atomic' accumulates with atomics, so it cannot be row_invariant=True")
            if num_tokens > self.atomic_max_tokens:
                raise PathUnavailableError(
                    f"path='atomic' serves num_tokens <= {self.atomic_max_tokens} (atomic_max_tokens), got {num_tokens}"
                )

    def select_path(self, num_tokens: int, path: Optional[str] = None) -> str:
        """The path a forward of `num_tokens` rows takes (validates a forced one)."""
        p = path or self.default_path
        if p not in PATHS:
            raise PathUnavailableError(f"path={p!r}: must be one of {PATHS}")
        if p == "auto":
            if self.row_invariant:  # one path for every N: a row's bits never depend on N
                return "prefill"
            return "decode" if num_tokens <= self.decode_max_tokens else "prefill"
        self._check_path(p, num_tokens, self.cfg)
        return p

    # --- the forward ---------------------------------------------------------------------
    def _stream(self, stream: int):
        s = self._streams.get(stream)
        if s is not None:
            return s
        import cupy

        if stream not in (0, 1, 2):  # legacy / per-thread default streams belong to the current context
            ctx = cupy.cuda.driver.streamGetCtx(stream)
            if ctx != self._ctx:
                raise MoeCallError(
                    f"stream 0x{stream:x} belongs to another device's context than this layer's device {self.device_id}"
                )
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            s = cupy.cuda.Stream.from_external(_StreamHandle(stream))
        else:
            s = cupy.cuda.ExternalStream(stream, self.device_id)
        self._streams[stream] = s
        return s

    def _check_call(self, input_ptr: int, num_tokens: int, output_ptr: int, token_ids_ptr: int) -> None:
        if not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool):
            raise MoeCallError(f"num_tokens={num_tokens!r}: must be an int")
        if not 1 <= num_tokens <= self.max_tokens:
            raise MoeCallError(f"num_tokens={num_tokens}: must be in 1..max_tokens={self.max_tokens}")
        for name, p in (("input_ptr", input_ptr), ("output_ptr", output_ptr)):
            if not isinstance(p, (int, np.integer)) or p == 0:
                raise MoeCallError(f"{name}={p!r}: a non-null device pointer (int) is required")
            if p % 16:
                raise MoeCallError(f"{name}=0x{int(p):x}: must be 16-byte aligned (the kernels read 16-byte vectors)")
        if self.cfg.hash_routing:
            if not token_ids_ptr:
                raise MoeCallError("hash routing (tid2eid) needs token_ids_ptr: a device pointer to num_tokens int32 ids")
            if token_ids_ptr % 4:
                raise MoeCallError(f"token_ids_ptr=0x{int(token_ids_ptr):x}: must be 4-byte aligned (int32)")

    def forward(self, input_ptr: int, num_tokens: int, output_ptr: int, stream: int, *,
                token_ids_ptr: int = 0, path: Optional[str] = None) -> None:
        """Enqueue the layer on `stream`: output[N, H] bf16 = MoE(input[N, H] bf16)."""
        self._check_call(input_ptr, num_tokens, output_ptr, token_ids_ptr)
        p = self.select_path(num_tokens, path)
        s = self._stream(int(stream))
        debug = profile_enabled() or dump_dir() is not None
        if debug and s.is_capturing():
            raise MoeCallError("CUPYMOE_PROFILE / CUPYMOE_DUMP_DIR synchronise the stream; unset them while capturing a graph")
        self._enqueue(int(input_ptr), int(num_tokens), int(output_ptr), s, int(token_ids_ptr), p)
        if dump_dir() is not None:
            self._dump(int(input_ptr), int(num_tokens), int(output_ptr), s, p)

    def _enqueue(self, x: int, N: int, out: int, s, token_ids: int, path: str) -> None:
        cfg, A, W, lib = self.cfg, self.arena, self.weights, self.lib
        H, R, k, E = cfg.hidden_size, cfg.router_width, cfg.num_experts_per_tok, cfg.num_experts
        atomic = path == "atomic"
        timer = StageTimer(s, N, path)

        # a few decode rows: routing and the expert lists in one launch (one fewer in the chain)
        route_lists_smem = (N * (2 * R + 64) + 2 * N * k + R) * 4  # decode.cu: scratch, lists, slot table
        route_lists = path != "prefill" and N <= ROUTE_LISTS_MAX_ROWS and route_lists_smem <= 48 * 1024
        # w8a8: the expert inputs' e4m3 codes are made by stages that run anyway: x's by the
        # router on the decode path (it reads x; its warps share the rows' 256-column chunks)
        # but at a row or two by route_lists' idle warps (route_lists_quantizes), by the
        # routing stage on the grouped path (which reads nothing of x otherwise); the norm's
        # output's by the norm; the activation's by the gate/up kernels
        w8a8 = self.fp8_compute == "w8a8"
        qx_of_x = (0, 0)
        if w8a8 and not cfg.pre_expert_norm:
            qx_of_x = (A.ptr("qx"), A.ptr("sx"))
        elif w8a8 and self._w8a8_shared_x:
            qx_of_x = (A.ptr("qx_shared"), A.ptr("sx_shared"))
        splits = 1
        with timer.stage("router"):
            if path == "prefill":  # tensor cores; the CUDA-core router only pays off at few rows
                name, threads, smem, bn, bm = self._grouped_kernel(2, self._router_config(N))
                splits = self._router_splits(-(-R // bn) * -(-N // bm))
                lib[name](
                    (-(-R // bn), -(-N // bm), splits), (threads,),
                    (_u64(x), _u64(0), _u64(0), _u64(0), _u64(0), _u64(0), _u64(0), _u64(W.ptr("router")),
                     _u64(0), _u64(W.ptr("router_bias")), _u64(0), *(_u64(0),) * 5,
                     _u64(0), _u64(0), _i32(0), _i32(H), _i32(R),
                     _i32(N), _u64(A.ptr("logits")), _i32(0), _f32(0.0), _f32(0.0)),
                    stream=s, shared_mem=smem)
            elif route_lists and route_lists_quantizes(N, H):  # beside the routing
                self._launch_router(x, N, A.ptr("logits"), s)
            else:
                self._launch_router(x, N, A.ptr("logits"), s, *qx_of_x)
                qx_of_x = (0, 0)  # made: the routing stage leaves x alone
        has_shared = 1 if cfg.has_shared_expert else 0
        routing = (_u64(A.ptr("logits")), _u64(W.ptr("correction_bias")), _u64(W.ptr("tid2eid")), _u64(token_ids),
                   _u64(A.ptr("topk_ids")), _u64(A.ptr("topk_w")), _u64(A.ptr("err")),
                   _i32(N), _i32(R), _i32(E), _i32(k), _i32(kernels.SCORING_CODES[cfg.scoring_func]),
                   _i32(cfg.n_group), _i32(cfg.topk_group), _i32(int(cfg.topk_then_softmax)),
                   _i32(int(cfg.norm_topk_prob)), _f32(cfg.routed_scaling_factor), _i32(cfg.hash_vocab_size))
        # the decode chain by programmatic dependent launch (router -> route_lists, or top-k ->
        # lists, -> norm -> gate/up -> down -> reduce, each kernel waiting for the one before
        # it); not on the atomic path, whose memset stands between the lists and gate/up. (The
        # prefill chain's measured the same with it and without, NOTES.md v25.)
        pdl = self._pdl and path == "decode" and not timer.separates_kernels
        # past those rows, up to a row a routing warp: top-k and the lists in one launch (x's
        # codes made by the router then; not after a split router, whose copies top-k sums,
        # nor for routers wider than decode_topk_lists routes as topk_route does). Measured
        # (NOTES.md v31): qwen3-30b-a3b N = 16 fp8 126.2 -> 124.6 us, nvfp4 116.7 -> 115.1; at
        # N = 64, four rows a warp, slower than topk_route's 16 blocks (fp8 188.3 -> 193.5)
        topk_lists_smem = ((TOPK_LISTS_WARPS * (2 * R + 64) + R) * 4  # routing scratch, slot table, then the lists'
                           + kernels.expert_lists_smem_bytes(N * k, W.n_local))
        topk_lists = (self._topk_lists and path != "prefill" and not route_lists and N <= TOPK_LISTS_WARPS
                      and N * k <= SMALL_SORT_PAIRS and splits == 1 and R <= TOPK_LISTS_MAX_R
                      and topk_lists_smem <= 48 * 1024)
        group_regs = 1 if cfg.n_group > 1 else 0  # the top-k kernels' instance for group-limited routers
        with timer.stage("topk"):
            if route_lists:
                self._launch("decode_route_lists", (1,), (ROUTE_LISTS_THREADS,),
                             (*routing, _u64(W.ptr("slot_of")), _i32(W.n_local), _i32(has_shared),
                              *self._list_outputs(), _u64(x), _i32(H), _u64(qx_of_x[0]), _u64(qx_of_x[1])),
                             s, route_lists_smem, pdl=pdl)
            elif topk_lists:
                assert qx_of_x == (0, 0), "x's codes are the router's past decode_route_lists' rows"
                self._launch(f"decode_topk_lists<{group_regs}>", (1,), (LISTS_THREADS,),
                             (*routing, _u64(W.ptr("slot_of")), _i32(W.n_local), _i32(has_shared),
                              *self._list_outputs()),
                             s, topk_lists_smem, pdl=pdl)
            else:
                warps = 4
                self._launch(f"topk_route<{group_regs}>", ((N + warps - 1) // warps,), (warps * 32,),
                             (*routing, _u64(x), _i32(H), _u64(qx_of_x[0]), _u64(qx_of_x[1]), _i32(splits)),
                             s, warps * (2 * R + 64) * 4, pdl=pdl)
        xe = x
        if cfg.pre_expert_norm:
            with timer.stage("norm"):
                xe = A.ptr("xe")
                qxe = (A.ptr("qx"), A.ptr("sx")) if w8a8 else (0, 0)
                self._launch("rmsnorm_bf16", (N,), (256,), (_u64(x), _u64(W.ptr("norm_weight")), _u64(xe), _i32(H),
                                                            _f32(cfg.rms_norm_eps), _u64(qxe[0]), _u64(qxe[1])),
                             s, pdl=pdl)
        tiles_bm = (0, 0)  # the tile heights the sort built the grouped GEMMs' tiles for
        with timer.stage("sort"):
            if not (route_lists or topk_lists):
                gate_up_bm = down_bm = 0
                if path == "prefill":
                    config, fmt0 = self._grouped_config(N), self._format_codes[0]
                    gate_up_bm = self._grouped_kernel(0, config, fmt0)[4]
                    down_bm = self._grouped_kernel(1, config, fmt0)[4]
                tiles_bm = self._launch_sort(N, s, has_shared, gate_up_bm, down_bm if down_bm != gate_up_bm else 0,
                                             pdl=pdl)
            if atomic:
                import cupy

                cupy.cuda.runtime.memsetAsync(A.ptr("acc"), 0, N * H * 4, s.ptr)
        if path == "prefill":
            self._enqueue_grouped(x, xe, N, out, s, timer, has_shared, *tiles_bm)
        else:
            self._enqueue_decode(x, xe, N, out, s, timer, has_shared, atomic, pdl)
        if self.comm is not None:  # partials -> the full layer, on the caller's stream
            with timer.stage("all_reduce"):
                self.comm.all_reduce(out, N * H * 2, "bf16", s.ptr)

    def _enqueue_decode(self, x: int, xe: int, N: int, out: int, s, timer, has_shared: int, atomic: bool,
                        pdl: bool = False) -> None:
        cfg, A, W = self.cfg, self.arena, self.weights
        H, k = cfg.hidden_size, cfg.num_experts_per_tok
        max_active = max(1, min(W.n_local, N * k) + has_shared)
        rows_per_expert = max(1.0, 2.0 * N * k / max(W.n_local, 1))
        # w8a8: the fp8 experts' kernels read the inputs' e4m3 codes (made by the routing stage
        # or the norm), and gate/up writes the activation's next to its bf16 values
        fp8 = kernels.FORMAT_CODES["fp8_block"]
        # the wgmma gate/up's blocks by table slot, their weights in flight before the lists
        # land, where one list builder made them (with slot_active) and the blocks of experts
        # nobody chose would copy few bytes for nothing (WGMMA_GATE_UP_AHEAD_MAX_WASTE)
        waste = gate_up_ahead_waste(W.n_local, cfg.num_experts, k, N, W.i_max)
        by_slot = (N * k <= SMALL_SORT_PAIRS and waste <= WGMMA_GATE_UP_AHEAD_MAX_WASTE
                   and max_active == W.n_local + has_shared)
        with timer.stage("gate_up"):
            for fmt in self._format_codes:  # one launch per weight format; each skips the others' experts
                name, blocks, threads, smem = self._decode_launch("gate_up", fmt, rows_per_expert, max_active)
                slot_grid = by_slot and name.startswith("decode_wgmma_gate_up_a8")
                a8 = ()
                if fmt == fp8 and self._w8a8_args:
                    a8 = (*self._w8a8_args, _u64(A.ptr("act_tickets")), _u64(A.ptr("slot_active") if slot_grid else 0))
                self._launch(
                    name, (blocks, max_active), (threads,),
                    (_u64(x), _u64(xe), _u64(A.ptr("num_active")), _u64(A.ptr("active_slot")),
                     _u64(A.ptr("active_start")), _u64(A.ptr("active_len")), _u64(A.ptr("sorted_row")),
                     _u64(W.ptr("gate")), _u64(W.ptr("up")), _u64(W.ptr("gate_scale")), _u64(W.ptr("up_scale")),
                     _u64(W.ptr("gate_gscale")), _u64(W.ptr("up_gscale")), _u64(W.ptr("slot_fmt")),
                     _u64(W.ptr("gate_bias")), _u64(W.ptr("up_bias")),
                     _u64(W.ptr("inter")), _i32(W.shared_slot), _u64(A.ptr("act")), _i32(H), _i32(W.i_max),
                     _i32(kernels.ACTIVATION_CODES[cfg.hidden_act]), _f32(cfg.swiglu_alpha), _f32(cfg.swiglu_limit),
                     *a8),
                    s, smem, pdl=pdl)
        with timer.stage("down"):
            for fmt in self._format_codes:
                a8 = self._w8a8_args[4:] if fmt == fp8 and self._w8a8_args else ()  # the activation's codes, scales
                name, blocks, threads, smem = self._decode_launch("down", fmt, rows_per_expert, max_active, N)
                self._launch(
                    name, (blocks, max_active), (threads,),
                    (_u64(A.ptr("act")), _u64(A.ptr("num_active")), _u64(A.ptr("active_slot")),
                     _u64(A.ptr("active_start")), _u64(A.ptr("active_len")), _u64(A.ptr("sorted_pair")),
                     _u64(W.ptr("down")), _u64(W.ptr("down_scale")), _u64(W.ptr("down_gscale")),
                     _u64(W.ptr("slot_fmt")), _u64(W.ptr("down_bias")), _u64(W.ptr("inter")), _u64(A.ptr("topk_w")),
                     _u64(A.ptr("y")), _u64(A.ptr("acc")), _i32(H), _i32(W.i_max), _i32(k), _i32(N * k),
                     _i32(int(atomic)), *a8),
                    s, smem, pdl=pdl)
        with timer.stage("reduce"):
            self._launch_reduce(x, xe, out, N, s, atomic, has_shared, pdl)

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple, s, shared_mem: int = 0,
                pdl: bool = False) -> None:
        """Launch kernel `name` on stream `s`; `pdl`: by programmatic dependent launch (the
        kernel must begin with pdl_wait_then_release_next)."""
        fn = self.lib[name]
        if pdl:
            kernels.launch_pdl(fn, grid, block, args, s.ptr, shared_mem)
        else:
            fn(grid, block, args, stream=s, shared_mem=shared_mem)

    def _decode_launch(self, stage: str, fmt: int, rows_per_expert: float,
                       max_active: int, n_rows: int = 0) -> tuple[str, int, int, int]:
        """(kernel, column blocks, threads a block, dynamic shared memory) of a decode stage
        for the experts of format `fmt`: the wgmma kernels where _w8a8_decode_kernel (fp8-block
        as w8a8) or _fp4_wgmma_decode_kernel (nvfp4, mxfp4) takes them, else _decode_kernel's
        (256 threads, static shared memory only)."""
        wg = (self._w8a8_decode_kernel(stage, rows_per_expert, max_active)
              if fmt == kernels.FORMAT_CODES["fp8_block"]
              else self._fp4_wgmma_decode_kernel(stage, fmt, rows_per_expert, max_active, n_rows)
              if fmt in self._mma_decode_formats else None)
        if wg is not None:
            return wg
        columns = self.weights.i_max if stage == "gate_up" else self.cfg.hidden_size
        return (*self._decode_kernel(stage, fmt, rows_per_expert, columns, max_active), 256, 0)

    def _w8a8_decode_kernel(self, stage: str, rows_per_expert: float,
                            max_active: int) -> Optional[tuple[str, int, int, int]]:
        """decode_wgmma_a8.cu's launch of a stage for this layer's fp8-block experts as
        (kernel, column blocks, threads, dynamic shared memory), or None where decode_mma.cu's
        _a8 kernels serve: w8a16, or in "auto" a gate/up grid of `max_active` experts under
        WGMMA_DECODE_MIN_WAVES waves. A pass takes 8 rows up to 8 rows a busy expert (rarer
        longer runs take two passes), 16 up to 16, else 32."""
        mode = self._w8a8_decode_mode
        if self.fp8_compute != "w8a8" or mode == "mma":
            return None
        H, i_max = self.cfg.hidden_size, self.weights.i_max
        gate_up_blocks = -(-i_max // kernels.WGMMA_DECODE_GATE_UP_COLUMNS)
        if mode == "auto" and gate_up_blocks * max_active < WGMMA_DECODE_MIN_WAVES * 2 * self._sm_count:
            return None
        nt = 8 if rows_per_expert <= 8 else 16 if rows_per_expert <= 16 else 32
        if stage == "gate_up":
            blocks, k = gate_up_blocks, H
        else:
            blocks, k = -(-H // kernels.WGMMA_DECODE_ROWS), i_max
        return (f"decode_wgmma_{stage}_a8<{nt}>", blocks, kernels.WGMMA_DECODE_THREADS,
                kernels.wgmma_decode_smem_bytes(nt, -(-k // 128)))

    def _fp4_wgmma_decode_kernel(self, stage: str, fmt: int, rows_per_expert: float, max_active: int,
                                 n_rows: int = 0) -> Optional[tuple[str, int, int, int]]:
        """decode_wgmma_fp4.cu's launch of a stage for this layer's experts of fp4 format
        `fmt` as (kernel, column blocks, threads, dynamic shared memory), or None where
        decode_mma.cu's fp4 kernels serve: mode "mma", a K the kernels cannot read
        (_fp4_wgmma_ok), or in "auto" a gate/up grid under WGMMA_FP4_DECODE_MIN_WAVES waves
        (of WGMMA_FP4_DECODE_BLOCKS_PER_SM blocks an SM).
        A pass takes 8 rows up to 8 rows a busy expert, else 16. Down's blocks take
        _fp4_down_tiles(n_rows) tiles of 128 hidden columns each."""
        mode = self._fp4_decode_mode
        if mode == "mma" or not self._fp4_wgmma_ok:
            return None
        H, i_max = self.cfg.hidden_size, self.weights.i_max
        gate_up_blocks = -(-i_max // kernels.WGMMA_DECODE_GATE_UP_COLUMNS)
        wave = WGMMA_FP4_DECODE_BLOCKS_PER_SM * self._sm_count
        if mode == "auto" and gate_up_blocks * max_active < WGMMA_FP4_DECODE_MIN_WAVES * wave:
            return None
        nt = 8 if rows_per_expert <= 8 else 16
        if stage == "gate_up":
            blocks = gate_up_blocks
        else:
            blocks = H // (kernels.WGMMA_DECODE_ROWS * self._fp4_down_tiles(n_rows))
        return (f"decode_wgmma_{stage}_fp4<{fmt}, {nt}>", blocks, kernels.WGMMA_DECODE_THREADS,
                kernels.wgmma_fp4_decode_smem_bytes(fmt, nt))

    def _fp4_down_tiles(self, n_rows: int) -> int:
        """128-row tiles a block of decode_wgmma_down_fp4 takes at `n_rows` rows (its grid
        H / (128 tiles)): two where the routed experts' I is at most FP4_DOWN_TILES_MAX_STAGES
        ring stages and the experts `n_rows` rows are expected to choose (uniform routing)
        give a wave of such blocks, else one; CUPYMOE_FP4_DOWN_TILES (read when the layer is
        built) forces a count (one where it does not divide H / 128)."""
        cfg = self.cfg
        tiles_h = cfg.hidden_size // kernels.WGMMA_DECODE_ROWS
        forced = self._fp4_down_tiles_forced
        if forced is not None:
            return forced if tiles_h % forced == 0 else 1
        stages = -(-cfg.moe_intermediate_size // (kernels.WGMMA_FP4_DECODE_KSUB * 128))  # the ring's stages
        if tiles_h % 2 or stages > FP4_DOWN_TILES_MAX_STAGES:
            return 1
        k, E, n_local = cfg.num_experts_per_tok, cfg.num_experts, self.weights.n_local
        active = n_local * (1.0 - (1.0 - min(1.0, k / E)) ** n_rows)
        wave = WGMMA_FP4_DECODE_BLOCKS_PER_SM * self._sm_count
        return 2 if tiles_h // 2 * active >= wave else 1

    def _decode_kernel(self, stage: str, fmt: int, rows_per_expert: float, columns: int,
                       max_active: int) -> tuple[str, int]:
        """(kernel, column blocks) of a decode stage ("gate_up": `columns` = I_max, "down": H)
        for weights of format `fmt`, `rows_per_expert` the rows a busy expert is expected to
        get. fp4 and fp8 on tensor cores (decode_mma.cu; fp8 as w8a8 on its `_a8` kernels
        where the layer computes fp8 so): the fewest K splits that still put enough blocks on
        every SM, 16-token passes past 8 rows. Else the CUDA-core stream: the row tile holding
        those rows, the fewest columns a warp that fill one wave."""
        a8 = fmt == kernels.FORMAT_CODES["fp8_block"] and self.fp8_compute == "w8a8"
        if a8 or fmt in self._mma_decode_formats:
            nt = 2 if rows_per_expert > 8 else 1
            want = self._mma_blocks_per_sm * self._sm_count
            # down: two fragments a warp where half the blocks still fill every SM unsplit
            # (deepseek-v3 at N = 1: 224 blocks instead of 448, one wave instead of 1.7)
            pairs = -(-columns // (32 * 8))
            if stage == "down" and self._mma_down_pairs and pairs * max_active >= want:
                return (f"decode_mma_down_a8<1, {nt}, 2>" if a8 else f"decode_mma_down<{fmt}, 1, {nt}, 2>"), pairs
            for ks in kernels.MMA_DECODE_K_SPLITS:
                blocks = -(-columns // (16 * 8 // ks))
                if blocks * max_active >= want:
                    break
            return (f"decode_mma_{stage}_a8<{ks}, {nt}>" if a8 else f"decode_mma_{stage}<{fmt}, {ks}, {nt}>"), blocks
        rt = _row_tile(rows_per_expert, kernels.GATE_UP_ROW_TILES if stage == "gate_up" else kernels.ROW_TILES)
        cw = _cols_per_warp(max_active * columns, rt, kernels.GATE_UP_VARIANTS if stage == "gate_up"
                            else kernels.DOWN_VARIANTS)
        return f"decode_{stage}<{rt}, {cw}, {fmt}>", -(-columns // (8 * cw))

    def _grouped_kernel(self, mode: int, config: str, fmt: int = 0) -> tuple[str, int, int, int, int]:
        """(kernel, threads, dynamic smem, weight rows per tile, rows per tile) of a grouped
        GEMM: fp8 as w8a8 on its own Hopper kernel; wgmma on Hopper where the math decides and
        the weights are bf16 or fp4 (dequantized into the B tiles), except for row-invariant
        layers, whose every N must run the same instructions (the mma.sync configurations
        agree bit for bit; wgmma need not). Otherwise the mma.sync kernel, quantized weights
        dequantized in it, in its quantized streaming configuration where bf16 takes
        "stream". A tile covers half its weight rows' columns of gate/up (gate and up rows),
        all of them for down and the router."""
        if fmt == kernels.FORMAT_CODES["fp8_block"] and self.fp8_compute == "w8a8":
            bm, bn = kernels.SM90_FP8_TILE[:2]
            return f"grouped_gemm_sm90_fp8<{mode}>", 256, kernels.sm90_fp8_smem_bytes(), bn, bm
        v = self._sm90[mode]
        if config == "math" and v.serves(fmt, mode) and self.lib.arch == "sm_90a" and not self.row_invariant:
            return v.kernel(mode, fmt), v.threads(mode), v.smem_bytes(fmt), v.bn, v.bm
        config = kernels.QUANT_CONFIG[config] if fmt else config
        return (*kernels.grouped_kernel(mode, config, fmt), kernels.GROUPED_BN, kernels.GROUPED_CONFIGS[config][0])

    def _list_outputs(self) -> tuple:
        """The expert lists' buffers, as decode_build_lists writes them."""
        A = self.arena
        return tuple(_u64(A.ptr(n)) for n in ("num_active", "active_slot", "active_start", "active_len",
                                               "sorted_row", "sorted_pair", "pair_pos", "slot_active"))

    def _launch_sort(self, N: int, s, has_shared: int, tile_bm: int = 0, down_bm: int = 0,
                     pdl: bool = False) -> tuple[int, int]:
        """(row, slot) pairs grouped by expert, stable: one block for few pairs, else three
        passes, whose scan also builds `tile_bm`-row tiles where tile_bm > 0 (tile_info),
        and `down_bm`-row ones where down_bm > 0 (tile_info_down). Returns the tile heights
        it built (0: none)."""
        cfg, A, W = self.cfg, self.arena, self.weights
        k = cfg.num_experts_per_tok
        P = N * k
        lists = (_u64(A.ptr("num_active")), _u64(A.ptr("active_slot")), _u64(A.ptr("active_start")),
                 _u64(A.ptr("active_len")))
        R = cfg.router_width
        lists_smem = R * 4 + kernels.expert_lists_smem_bytes(P, W.n_local)  # the slot table, then the lists'
        if P <= SMALL_SORT_PAIRS and lists_smem <= self.lib.max_smem:
            self._launch("decode_build_lists", (1,), (LISTS_THREADS,),
                         (_u64(A.ptr("topk_ids")), _i32(N), _i32(k), _u64(W.ptr("slot_of")), _i32(R),
                          _i32(W.n_local), _i32(has_shared), *self._list_outputs()),
                         s, lists_smem, pdl=pdl)
            return 0, 0
        nblk = -(-P // SORT_BLOCK)
        self._launch("sort_count", (nblk,), (SORT_BLOCK,),
                     (_u64(A.ptr("topk_ids")), _i32(P), _u64(W.ptr("slot_of")), _i32(cfg.router_width),
                      _i32(W.n_local), _u64(A.ptr("block_counts"))),
                     s, W.n_local * 4)
        self._launch("sort_scan", (1,), (SORT_BLOCK,),
                     (_u64(A.ptr("block_counts")), _i32(nblk), _i32(W.n_local), _i32(N), _i32(k),
                      _i32(has_shared), *lists, _i32(tile_bm), _u64(A.ptr("num_tiles")), _u64(A.ptr("tile_info")),
                      _i32(down_bm), _u64(A.ptr("num_tiles_down")), _u64(A.ptr("tile_info_down"))),
                     s)
        self._launch("sort_place", (nblk,), (SORT_BLOCK,),
                     (_u64(A.ptr("topk_ids")), _i32(P), _i32(N), _u64(W.ptr("slot_of")), _i32(cfg.router_width),
                      _i32(W.n_local), _i32(has_shared),
                      _u64(A.ptr("block_counts")), _u64(A.ptr("active_start")), _u64(A.ptr("num_active")),
                      _u64(A.ptr("sorted_row")), _u64(A.ptr("sorted_pair")), _u64(A.ptr("pair_pos")), _i32(k)),
                     s, kernels.sort_place_smem_bytes(W.n_local))
        return tile_bm, down_bm

    def _grouped_config(self, N: int) -> str:
        """The grouped GEMMs' configuration: the math-bound one once the average expert run
        fills enough of its 128-row tiles (bf16 on Hopper: the wgmma kernel, which pays off
        sooner); w8a8's tiles are 64 rows, and every format of the layer takes them."""
        if self.fp8_compute == "w8a8":
            return "stream"
        return "math" if N * self.cfg.num_experts_per_tok >= self._math_rows * self.weights.n_local else "stream"

    def _enqueue_grouped(self, x: int, xe: int, N: int, out: int, s, timer, has_shared: int,
                         tiles_bm: int = 0, down_tiles_bm: int = 0) -> None:
        """gate/up and down as tensor-core grouped GEMMs over BM-row tiles of each expert's
        run (tile_info holds `tiles_bm`-row tiles already, where the sort built them, and
        tile_info_down `down_tiles_bm`-row ones for down)."""
        cfg, A, W = self.cfg, self.arena, self.weights
        H, k = cfg.hidden_size, cfg.num_experts_per_tok
        config = self._grouped_config(N)
        fp8 = kernels.FORMAT_CODES["fp8_block"]

        def bound(bm: int) -> int:  # the grid's M-tiles for `bm`-row tiles
            return max(1, max_tiles(N, k, W.n_local, bool(has_shared), bm))

        tiles_bm = [tiles_bm]  # the tile height tile_info holds now

        def tile_list(bm: int, down: bool = False) -> tuple:
            """(num_tiles, tile_info) of `bm`-row tiles: down's own list where the sort built
            it; else tile_info, rebuilt unless it holds them already (a kernel of other tiles
            may follow: stream order lets the one before finish reading first)."""
            if down and bm == down_tiles_bm:
                return _u64(A.ptr("num_tiles_down")), _u64(A.ptr("tile_info_down"))
            if bm != tiles_bm[0]:
                self._launch("make_tiles", (1,), (1024,),
                             (_u64(A.ptr("num_active")), _u64(A.ptr("active_slot")), _u64(A.ptr("active_start")),
                              _u64(A.ptr("active_len")), _i32(bm), _u64(A.ptr("num_tiles")),
                              _u64(A.ptr("tile_info"))), s)
                tiles_bm[0] = bm
            return _u64(A.ptr("num_tiles")), _u64(A.ptr("tile_info"))

        with timer.stage("gate_up"):
            for fmt in self._format_codes:  # one launch per weight format; each skips the others' tiles
                gate_up, threads, smem, bn, bm = self._grouped_kernel(0, config, fmt)
                num_tiles, tile_info = tile_list(bm)
                extra = self._w8a8_args if fmt == fp8 else ()
                if gate_up.startswith("grouped_gemm_sm90_tma<"):
                    if self._gathers_rows:  # TMA reads the inputs in sorted order
                        self._launch("gather_rows", (bound(bm),), (256,),
                                     (_u64(x), _u64(xe), num_tiles, tile_info,
                                      _u64(A.ptr("sorted_row")), _i32(W.shared_slot), _i32(H), _u64(A.ptr("xg"))),
                                     s)
                    extra = (_u64(int(self._tma_maps.data.ptr)),)
                self._launch(
                    gate_up, (-(-W.i_max // (bn // 2)), bound(bm)), (threads,),
                    (_u64(x), _u64(xe), _u64(0), num_tiles, tile_info,
                     _u64(A.ptr("sorted_row")), _u64(A.ptr("sorted_pair")), _u64(W.ptr("gate")), _u64(W.ptr("up")),
                     _u64(W.ptr("gate_bias")), _u64(W.ptr("up_bias")), _u64(W.ptr("gate_scale")),
                     _u64(W.ptr("up_scale")), _u64(W.ptr("gate_gscale")), _u64(W.ptr("up_gscale")),
                     _u64(W.ptr("slot_fmt")), _u64(W.ptr("inter")), _u64(A.ptr("topk_w")),
                     _i32(W.shared_slot), _i32(H), _i32(W.i_max), _i32(N * k), _u64(A.ptr("act")),
                     _i32(kernels.ACTIVATION_CODES[cfg.hidden_act]), _f32(cfg.swiglu_alpha), _f32(cfg.swiglu_limit),
                     *extra),
                    s, smem)
        with timer.stage("down"):
            for fmt in self._format_codes:
                down, threads, smem, bn, bm = self._grouped_kernel(1, config, fmt)
                num_tiles, tile_info = tile_list(bm, down=True)
                qact = self._w8a8_args[4:]  # down reads the activation's codes; no q_out / s_out
                extra = (*qact, *qact, _u64(0), _u64(0)) if fmt == fp8 and self._w8a8_args else ()
                if down.startswith("grouped_gemm_sm90_tma<"):
                    extra = (_u64(int(self._tma_maps.data.ptr)),)
                self._launch(
                    down, (-(-H // bn), bound(bm)), (threads,),
                    (_u64(x), _u64(xe), _u64(A.ptr("act")), num_tiles, tile_info,
                     _u64(A.ptr("sorted_row")), _u64(A.ptr("sorted_pair")), _u64(W.ptr("down")), _u64(0),
                     _u64(W.ptr("down_bias")), _u64(0), _u64(W.ptr("down_scale")), _u64(0),
                     _u64(W.ptr("down_gscale")), _u64(0), _u64(W.ptr("slot_fmt")),
                     _u64(W.ptr("inter")), _u64(A.ptr("topk_w")),
                     _i32(W.shared_slot), _i32(H), _i32(W.i_max), _i32(N * k), _u64(A.ptr("yw")),
                     _i32(0), _f32(0.0), _f32(0.0), *extra),
                    s, smem)
        with timer.stage("reduce"):
            self._launch_grouped_reduce(x, xe, out, N, s, has_shared)

    def _launch_grouped_reduce(self, x: int, xe: int, out: int, N: int, s, has_shared: int) -> None:
        """The prefill path's unpermute + weighted reduce of `yw` (and the shared expert's rows)."""
        cfg, A, W = self.cfg, self.arena, self.weights
        self._launch(
            "grouped_reduce", (N,), (256,),
            (_u64(x), _u64(xe), _u64(A.ptr("topk_ids")), _u64(A.ptr("topk_w")), _u64(A.ptr("pair_pos")),
             _u64(A.ptr("yw")), _u64(W.ptr("shared_expert_gate")), _u64(out), _i32(N), _i32(cfg.hidden_size),
             _i32(cfg.num_experts_per_tok), _i32(cfg.num_experts), _i32(has_shared),
             _i32(1 if cfg.ep_rank == 0 else 0)),
            s)

    def _router_config(self, N: int) -> str:
        """The router GEMM's grouped configuration on the prefill path: "math" (128 x 128
        tiles) from 1024 rows, unless those tiles would leave over half the SMs idle (a
        narrow router: qwen3-30b-a3b at N = 4096 is 32 tiles); then "stream"'s smaller
        tiles, measured faster there (NOTES.md v19: router 30.5 -> 22.5 us, deepseek-v3
        106.7 -> 84.8; qwen3-next-80b's 128 tiles ran 32.3 -> 35.4 with them, so they
        stay math)."""
        if N < 1024:
            return "stream"
        if -(-self.cfg.router_width // 128) * -(-N // 128) * 2 < self._sm_count:
            return "stream"
        return "math"

    def _router_splits(self, tiles: int) -> int:
        """K splits of the prefill router's GEMM: enough for two blocks an SM where its
        tiles are few (qwen3-30b-a3b at N = 4096: 64 tiles of 64 x 128), each split at
        least 4 steps of 64; none for row-invariant layers, whose logits must not depend on
        N (a split sums in another order)."""
        if self.row_invariant:
            return 1
        steps = -(-self.cfg.hidden_size // 64)
        return max(1, min(ROUTER_MAX_SPLITS, 2 * self._sm_count // max(1, tiles), steps // 4))

    def _router_on_tensor_cores(self, N: int) -> bool:
        """Whether the decode path's router for `N` rows is router_mma.cu's (tensor cores, K
        split over a cluster) rather than router.cu's CUDA-core kernel."""
        mode = self._decode_router
        if mode == "auto":
            return self.cfg.router_width * N * self.cfg.hidden_size >= DECODE_ROUTER_MMA_MIN_MACS
        return mode == "mma"

    def _launch_router(self, x: int, N: int, logits: int, s, qx: int = 0, sx: int = 0) -> None:
        """The decode path's router logits; with `qx`, x's e4m3 codes and scales too (w8a8)."""
        cfg, W = self.cfg, self.weights
        R = cfg.router_width
        if self._router_on_tensor_cores(N):
            nt = _row_tile(-(-N // 8), kernels.ROUTER_MMA_TILES)
            self.lib[f"router_logits_mma<{nt}>"](
                (-(-R // kernels.ROUTER_MMA_COLS), kernels.ROUTER_MMA_CLUSTER, -(-N // (8 * nt))),
                (kernels.ROUTER_MMA_THREADS,),
                (_u64(x), _u64(W.ptr("router")), _u64(W.ptr("router_bias")), _u64(logits),
                 _i32(N), _i32(R), _i32(cfg.hidden_size), _u64(qx), _u64(sx)), stream=s)
            return
        rt = _row_tile(N, kernels.ROW_TILES)
        split = kernels.router_split(cfg.hidden_size)
        self.lib[f"router_logits_bf16<{rt}, {split}>"](
            ((R + 1) // 2, (N + rt - 1) // rt), (2 * split * 32,),  # 2 columns x `split` warps a block
            (_u64(x), _u64(W.ptr("router")), _u64(W.ptr("router_bias")), _u64(logits),
             _i32(N), _i32(R), _i32(cfg.hidden_size), _u64(qx), _u64(sx)), stream=s)

    def _launch_reduce(self, x: int, xe: int, out: int, N: int, s, atomic: bool, has_shared: int,
                       pdl: bool = False) -> None:
        cfg, A, W = self.cfg, self.arena, self.weights
        primary = 1 if cfg.ep_rank == 0 else 0
        H = cfg.hidden_size
        # few rows: H split over blocks until about two blocks an SM (a row alone in one
        # block is a latency chain of H / 1024 steps)
        splits = max(1, min(-(-H // (4 * REDUCE_THREADS)), 2 * self._sm_count // N))
        self._launch(
            "decode_reduce", (N, splits), (REDUCE_THREADS,),
            (_u64(x), _u64(xe), _u64(A.ptr("topk_ids")), _u64(A.ptr("topk_w")), _u64(A.ptr("pair_pos")),
             _u64(A.ptr("y")), _u64(A.ptr("acc")), _u64(W.ptr("shared_expert_gate")), _u64(out),
             _i32(N), _i32(cfg.hidden_size), _i32(cfg.num_experts_per_tok), _i32(cfg.num_experts),
             _i32(has_shared), _i32(primary), _i32(int(atomic))),
            s, pdl=pdl)

    def _dump(self, x: int, N: int, out: int, s, path: str) -> None:
        """The seed's debug dumps (CUPYMOE_DUMP_DIR); a debug aid with host syncs and copies."""
        import cupy

        cfg, A = self.cfg, self.arena
        H, k, R = cfg.hidden_size, cfg.num_experts_per_tok, cfg.router_width
        with cupy.cuda.Device(self.device_id):
            # `logits` shares bytes with `act`, so recompute them for the dump
            logits = cupy.empty((N, R), dtype=cupy.float32)
            self._launch_router(x, N, int(logits.data.ptr), s)
            # the routed-only output: the path's reduce again, without the shared expert (the
            # prefill path's reads yw; decode_reduce's y holds decode_max_tokens rows at most)
            routed = cupy.empty((N, H), dtype=cupy.uint16)
            xe = A.ptr("xe") if cfg.pre_expert_norm else x
            if path == "prefill":
                self._launch_grouped_reduce(x, xe, int(routed.data.ptr), N, s, 0)
            else:
                self._launch_reduce(x, xe, int(routed.data.ptr), N, s, path == "atomic", 0)
            arrays = {
                "gate_input": (x, (N, H), "bf16"),
                "gate_logits": (int(logits.data.ptr), (N, R), "float32"),
                "expert_ids": (A.ptr("topk_ids"), (N, k), "int32"),
                "expert_weights": (A.ptr("topk_w"), (N, k), "float32"),
                "routed_only": (int(routed.data.ptr), (N, H), "bf16"),
                "moe_out": (out, (N, H), "bf16"),
            }
            if cfg.has_shared_expert and path == "prefill":
                # the grouped path keeps no fp32 copy of the shared expert's output
                log.info("CUPYMOE_DUMP_DIR: shared_out is dumped on the decode and atomic paths only")
            elif cfg.has_shared_expert:  # the shared expert's rows sit contiguously in y
                s.synchronize()
                pos = np.empty(1, np.int32)
                cupy.cuda.runtime.memcpy(pos.ctypes.data, A.ptr("pair_pos") + N * k * 4, 4,
                                         cupy.cuda.runtime.memcpyDeviceToHost)
                arrays["shared_out"] = (A.ptr("y") + int(pos[0]) * H * 4, (N, H), "float32")
            write_dumps(s, arrays)

    # --- conveniences ----------------------------------------------------------------------
    def __call__(self, x, *, out=None, stream=None, token_ids=None, path: Optional[str] = None):
        """Run on a torch tensor (bf16, CUDA) or a CuPy array (uint16 bits of bf16), [N, H].

        Allocates `out` when not given (so not for graph capture: pass `out` there), then
        calls `forward` on the current stream of the tensor's framework (or `stream`).
        """
        H = self.cfg.hidden_size
        is_torch = type(x).__module__.startswith("torch")
        if is_torch:
            import torch

            if x.dtype != torch.bfloat16 or not x.is_cuda or x.dim() != 2 or x.shape[1] != H or not x.is_contiguous():
                raise MoeCallError(f"x: expected a contiguous CUDA bf16 tensor [N, {H}], got "
                                   f"{tuple(x.shape)} {x.dtype} on {x.device}")
            if out is None:
                out = torch.empty_like(x)
            elif out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(x.shape) or not out.is_contiguous():
                raise MoeCallError(f"out: expected a contiguous bf16 tensor {tuple(x.shape)}, got {tuple(out.shape)} {out.dtype}")
            if stream is None:
                stream = torch.cuda.current_stream(x.device).cuda_stream
            xp, op, n = x.data_ptr(), out.data_ptr(), x.shape[0]
            tp = 0 if token_ids is None else token_ids.data_ptr()
            if token_ids is not None and (token_ids.dtype != torch.int32 or token_ids.numel() != n):
                raise MoeCallError(f"token_ids: expected {n} int32 ids, got {token_ids.numel()} {token_ids.dtype}")
        else:
            import cupy

            if not isinstance(x, cupy.ndarray) or x.dtype != cupy.uint16 or x.ndim != 2 or x.shape[1] != H \
                    or not x.flags.c_contiguous:
                raise MoeCallError(f"x: expected a contiguous CuPy uint16 (bf16 bits) array [N, {H}], got "
                                   f"{getattr(x, 'shape', None)} {getattr(x, 'dtype', type(x))}")
            if out is None:
                out = cupy.empty_like(x)
            elif out.dtype != cupy.uint16 or out.shape != x.shape or not out.flags.c_contiguous:
                raise MoeCallError(f"out: expected a contiguous uint16 array {x.shape}, got {out.shape} {out.dtype}")
            if stream is None:
                stream = cupy.cuda.get_current_stream().ptr
            xp, op, n = int(x.data.ptr), int(out.data.ptr), x.shape[0]
            tp = 0 if token_ids is None else int(token_ids.data.ptr)
            if token_ids is not None and (token_ids.dtype != cupy.int32 or token_ids.size != n):
                raise MoeCallError(f"token_ids: expected {n} int32 ids, got {token_ids.size} {token_ids.dtype}")
        self.forward(xp, n, op, int(stream), token_ids_ptr=tp, path=path)
        return out

    def check_errors(self) -> None:
        """Synchronise and raise if a kernel flagged bad input (e.g. a token id outside tid2eid)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.deviceSynchronize()
            flags = np.zeros(1, np.int32)
            cupy.cuda.runtime.memcpy(flags.ctypes.data, self.arena.ptr("err"), 4, cupy.cuda.runtime.memcpyDeviceToHost)
            if flags[0]:
                cupy.cuda.runtime.memset(self.arena.ptr("err"), 0, 4)
                raise MoeCallError(f"a kernel flagged bad input (error bits 0x{int(flags[0]):x}: "
                                   "bit 0 = a token id outside 0..hash_vocab_size-1; those rows got no routed experts)")

    def _warmup_paths(self) -> list[str]:
        """The paths a one-row forward may take on this layer (select_path accepts them):
        row-invariant layers serve prefill alone, atomic_max_tokens 0 leaves atomic out."""
        paths = []
        for p in ("decode", "atomic", "prefill"):
            try:
                self.select_path(1, p)
            except PathUnavailableError:
                continue
            paths.append(p)
        return paths

    def warmup(self) -> None:
        """Launch every path this layer serves once on a scratch input, so first-launch costs
        stay out of capture."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            rng = np.random.default_rng(0)
            x = cupy.asarray((rng.standard_normal((1, self.cfg.hidden_size), dtype=np.float32)
                              .view(np.uint32) >> 16).astype(np.uint16))
            tids = cupy.zeros(1, cupy.int32)
            out = cupy.empty_like(x)
            s = cupy.cuda.Stream(non_blocking=True)
            for p in self._warmup_paths():
                self.forward(int(x.data.ptr), 1, int(out.data.ptr), s.ptr, token_ids_ptr=int(tids.data.ptr), path=p)
            s.synchronize()
