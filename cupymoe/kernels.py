"""Compiling and loading the cuda/ kernels: NVRTC through CuPy's bindings, one arch choice.

One compile path serves both the runtime (MoeLayer loads cubins onto its device) and the
GPU-less build check (`python -m cupymoe kernels --arch sm_90a`): NVRTC compiles each
module for an explicit real architecture (`sm_90a` on Hopper, so wgmma is available;
`sm_XY` elsewhere) straight to a cubin, with every template variant named up front
through name expressions. The arch is chosen here and only here: CuPy's RawModule adds
the device's own arch to the options, which collides with ours (DESIGN.md section 3).

Cubins are cached on disk, keyed by the module source, every header it can include, the
options, the arch and the NVRTC version (`CUPYMOE_CACHE_DIR`, default
~/.cache/cupymoe). Writes are atomic (temp file + rename), so several processes starting
at once at worst compile the same thing twice and never read a torn file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger(__name__)

# Codes shared with cuda/common.cuh and cuda/routing.cuh.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swiglu_oai": 3}
SCORING_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# Expert weight formats the kernels read (cuda/quant.cuh FMT_*): every decode and grouped
# expert kernel is built once per format. Quantized weights are dequantized in registers
# (W8A16 / W4A16) and multiplied on bf16 tensor cores / in fp32.
FORMAT_CODES = {"bf16": 0, "fp8_block": 1, "nvfp4": 2, "mxfp4": 3}
# the bits of one weight, and the K multiple a quantized matrix needs: the GEMM reads raw
# codes in whole 16-byte chunks (16 fp8 or 32 fp4 weights)
FORMAT_BITS = {"bf16": 16, "fp8_block": 8, "nvfp4": 4, "mxfp4": 4}
FORMAT_K_MULTIPLE = {"bf16": 8, "fp8_block": 16, "nvfp4": 32, "mxfp4": 32}

# Rows per weight pass (RT) in the router and decode kernels, and columns per warp (CW) in
# the decode kernels. Register use grows with RT * CW: both kernels stay at RT * CW <= 4
# (down<4, 2> spilled on sm_80), and down also has one-column tiles of 8 rows.
ROW_TILES = (1, 2, 4, 8)
# router_mma.cu router_logits_mma<NT>: n8 tiles of x rows a block (8 NT rows), its cluster
# (blocks a K split) and its block's router columns
ROUTER_MMA_TILES = (1, 2, 4, 8)
ROUTER_MMA_CLUSTER = 8
ROUTER_MMA_COLS = 32
ROUTER_MMA_THREADS = 512
GATE_UP_ROW_TILES = (1, 2, 4)
DECODE_COLS = (1, 2, 4)
GATE_UP_VARIANTS = tuple((rt, cw) for rt in GATE_UP_ROW_TILES for cw in DECODE_COLS if rt * cw <= 4)
DOWN_VARIANTS = tuple((rt, cw) for rt in ROW_TILES for cw in DECODE_COLS if rt * cw <= 4 or cw == 1)
# fp4 and fp8 decode on tensor cores (cuda/decode_mma.cu): warps of a block splitting K
MMA_DECODE_K_SPLITS = (1, 2, 4, 8)
FP4_DECODE_FORMATS = ("nvfp4", "mxfp4")
MMA_DECODE_FORMATS = FP4_DECODE_FORMATS + ("fp8_block",)
# mxfp4 scale bytes (2^(e - 127)) the tensor-core decode serves: it scales the weights by
# 2^-64 on the way, and they must stay normal bf16 numbers (cuda/decode_mma.cu); outside,
# the CUDA-core readers take the layer's mxfp4 weights
FP4_MMA_MXFP4_SCALE_BYTES = (66, 192)
# ... and 8-token B fragments per weight pass: 16 tokens halve the passes over the weights
# of an expert with more than 8 rows
MMA_DECODE_TOKEN_TILES = (1, 2)
# w8a8 decode on wgmma (cuda/decode_wgmma_a8.cu, sm_90a): rows of an expert's run a pass
# (the wgmmas' n), the ring's stages, the k128 steps a stage and the weight rows a block
# streams, as the file's WG_STAGES / WG_KSUB / WG_ROWS / WG_THREADS say
# (tests/test_kernels_build.py checks they agree)
WGMMA_DECODE_TOKEN_TILES = (8, 16, 32)
WGMMA_DECODE_STAGES = 3
WGMMA_DECODE_KSUB = 2
WGMMA_DECODE_ROWS = 128
WGMMA_DECODE_THREADS = 128
# gate/up's columns a block: its 128 rows are 64 gate rows and the same 64 up rows
WGMMA_DECODE_GATE_UP_COLUMNS = WGMMA_DECODE_ROWS // 2
# fp4 decode on wgmma (cuda/decode_wgmma_fp4.cu, sm_90a): rows of an expert's run a pass,
# the ring's stages and its k128 steps a stage, as the file's WF_STAGES / WF_KSUB say (its
# blocks are WGMMA_DECODE_ROWS weight rows, WGMMA_DECODE_THREADS threads, as the w8a8 ones)
WGMMA_FP4_DECODE_TOKEN_TILES = (8, 16)
WGMMA_FP4_DECODE_STAGES = 3
WGMMA_FP4_DECODE_KSUB = 2
# the CUDA-core router's warps per router row (router.cu), chosen by H alone
ROUTER_SPLITS = (4, 8)


def router_split(hidden_size: int) -> int:
    """Warps splitting H per router row (router.cu router_logits_bf16): 4 up to H = 4096,
    else 8, so a lane's share is at most 1024 columns (one round of loads up to H = 8192).
    A function of H alone: the split fixes the order of a logit's sums (row invariance)."""
    return 4 if hidden_size <= 4096 else 8


def _on_off(name: str) -> bool:
    """A measurement knob that is on unless the environment sets it to 0 (anything but 0 or 1
    is refused, naming the value)."""
    v = os.environ.get(name, "1")
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: must be '0' or '1'")
    return v == "1"


def positive_int_env(name: str) -> Optional[int]:
    """A knob that is a count: None when the environment does not set it, else a positive
    integer (anything else is refused, naming the value)."""
    v = os.environ.get(name)
    if v is None:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{name}={v!r}: must be a positive integer")
    return int(v)


def fp4_down_tiles() -> Optional[int]:
    """CUPYMOE_FP4_DOWN_TILES: 128-row weight tiles a block of decode_wgmma_down_fp4 takes
    one after another (None: the layer's rule, layer._fp4_down_tiles), for tests and
    measurements; the layer keeps one where H / 128 is not a multiple of it."""
    return positive_int_env("CUPYMOE_FP4_DOWN_TILES")


def mma_decode_down_pairs() -> bool:
    """Whether the tensor-core decode's down kernel may stream two 16-row fragments a warp
    (decode_mma_down<..., CF = 2>: half the blocks, where they still fill every SM without a
    K split; cuda/decode_mma.cu). CUPYMOE_MMA_DECODE_DOWN_PAIRS=0 keeps one, for measurements."""
    return _on_off("CUPYMOE_MMA_DECODE_DOWN_PAIRS")


def mma_decode_blocks_per_sm() -> int:
    """Blocks per SM the tensor-core decode kernels' K split aims for (the fewest splits
    reaching it); CUPYMOE_MMA_DECODE_BLOCKS_PER_SM overrides it for measurements. One: at
    two, few experts (N = 1) took twice the splits and 1.45 waves of blocks, and ran slower
    (qwen3-30b-a3b fp8 N = 1 33.9 against 30.0 us, nvfp4 31.6 against 28.4); from 8 rows on
    both chose alike (benchmarks/NOTES.md v20)."""
    return positive_int_env("CUPYMOE_MMA_DECODE_BLOCKS_PER_SM") or 1


def fp4_decode_mode() -> str:
    """Where fp4 decodes (CUPYMOE_FP4_DECODE): "auto" (tensor cores: decode_wgmma_fp4.cu's
    kernels where layer._fp4_wgmma_decode_kernel takes them, decode_mma.cu's elsewhere), or,
    for tests and measurements, "mma" / "wgmma" (one of them wherever it can run) or "cores"
    (decode.cu's CUDA-core streams)."""
    v = os.environ.get("CUPYMOE_FP4_DECODE", "auto")
    if v not in ("auto", "mma", "wgmma", "cores"):
        raise ValueError(f"CUPYMOE_FP4_DECODE={v!r}: must be 'auto', 'mma', 'wgmma' or 'cores'")
    return v


def decode_router_mode() -> str:
    """The decode path's router (CUPYMOE_DECODE_ROUTER): "auto" (router_mma.cu's tensor-core
    kernel on sm_90a from layer.DECODE_ROUTER_MMA_MIN_MACS multiply-adds, else router.cu's
    CUDA-core one), or, for tests and measurements, "mma" (the tensor-core one wherever it
    can run) or "cores"."""
    v = os.environ.get("CUPYMOE_DECODE_ROUTER", "auto")
    if v not in ("auto", "mma", "cores"):
        raise ValueError(f"CUPYMOE_DECODE_ROUTER={v!r}: must be 'auto', 'mma' or 'cores'")
    return v


def pdl_mode() -> bool:
    """Whether the decode chain's kernels are launched with programmatic dependent launch
    (sm_90+, launch_pdl): CUPYMOE_PDL=0 turns it off, for measurements."""
    return _on_off("CUPYMOE_PDL")


def topk_lists_mode() -> bool:
    """Whether the decode path past decode_route_lists' rows routes and builds the expert
    lists in one launch (decode.cu decode_topk_lists) where one block sorts the pairs:
    CUPYMOE_TOPK_LISTS=0 launches topk_route and decode_build_lists instead, for measurements."""
    return _on_off("CUPYMOE_TOPK_LISTS")


# cuLaunchKernelEx's configuration (cuda.h): CUlaunchAttribute is an id padded to 8 bytes
# and a 64-byte value union; CUlaunchConfig the grid, block, dynamic shared memory, stream
# and the attribute array.
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttributeValue(ctypes.Union):  # 64 bytes; the int member this layer sets
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


def _launch_structs():
    """(CUlaunchAttribute, CUlaunchConfig) as ctypes structures (defined once, above)."""
    return _LaunchAttribute, _LaunchConfig


# the one attribute every programmatic launch passes (the driver reads it during the call)
_PDL_ATTRIBUTE = _LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL_ATTRIBUTE.value.programmatic_stream_serialization_allowed = 1

_LIBCUDA = None


def _dims(d: tuple):
    return (ctypes.c_uint * 3)(*(tuple(int(v) for v in d) + (1, 1))[:3])


def pack_launch(grid: tuple, block: tuple, args: tuple, stream_ptr: int, shared_mem: int = 0):
    """(config, params, keep-alive) for cuLaunchKernelEx with programmatic stream
    serialization: `args` numpy scalars (the layer's _u64 / _i32 / _f32), each passed by
    address as the driver API takes kernel parameters."""
    import numpy as np

    cfg = _LaunchConfig(_dims(grid), _dims(block), int(shared_mem), ctypes.c_void_p(int(stream_ptr)),
                        ctypes.pointer(_PDL_ATTRIBUTE), 1)
    held = [np.array(a) for a in args]  # numpy scalars keep their dtype: the kernel's C types
    params = (ctypes.c_void_p * len(held))(*[h.ctypes.data for h in held])
    return cfg, params, held


def launch_pdl(fn, grid: tuple, block: tuple, args: tuple, stream_ptr: int, shared_mem: int = 0) -> None:
    """Launch `fn` (a CuPy module function) with programmatic stream serialization: it may
    start while the stream's previous kernel still runs, and must wait for it itself
    (cuda/common.cuh pdl_wait_then_release_next). Stream capture records the edge."""
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        _LIBCUDA.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cfg, params, held = pack_launch(grid, block, args, stream_ptr, shared_mem)
    err = _LIBCUDA.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(int(fn.ptr)), params, None)
    if err != 0:
        msg = ctypes.c_char_p()
        _LIBCUDA.cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err} ({(msg.value or b'?').decode()})")
    del held  # the driver copied the parameters during the call


def fp8_decode_mode() -> str:
    """Where fp8-block experts decode as w8a16 (a layer computing fp8 as w8a8 always takes
    decode_mma.cu's _a8 kernels): "mma" (tensor cores, decode_mma.cu), or "cores" with
    CUPYMOE_FP8_DECODE=cores (decode.cu's CUDA-core readers)."""
    v = os.environ.get("CUPYMOE_FP8_DECODE", "mma")
    if v not in ("mma", "cores"):
        raise ValueError(f"CUPYMOE_FP8_DECODE={v!r}: must be 'mma' or 'cores'")
    return v


def w8a8_decode_mode() -> str:
    """Which kernels decode fp8-block experts as w8a8: "auto" (layer._w8a8_decode_kernel:
    decode_wgmma_a8.cu's where their grid holds layer.WGMMA_DECODE_MIN_WAVES waves,
    decode_mma.cu's _a8 below), or "mma" / "wgmma" (CUPYMOE_W8A8_DECODE, for tests and
    measurements: one of them at every N)."""
    v = os.environ.get("CUPYMOE_W8A8_DECODE", "auto")
    if v not in ("auto", "mma", "wgmma"):
        raise ValueError(f"CUPYMOE_W8A8_DECODE={v!r}: must be 'auto', 'mma' or 'wgmma'")
    return v


def wgmma_decode_smem_bytes(token_tile: int, k_steps: int) -> int:
    """Dynamic shared memory of a decode_wgmma_*_a8<token_tile> launch whose K has `k_steps`
    k128 steps (the layout of decode_wgmma_a8.cu's wg_block): 1024 to align the ring, its stages (the weight
    rows and the pass's rows, 128 codes each a k step), and every step's scales (two weight
    tiles', each row's)."""
    stage = (WGMMA_DECODE_ROWS + token_tile) * 128 * WGMMA_DECODE_KSUB
    return 1024 + WGMMA_DECODE_STAGES * stage + (2 + token_tile) * k_steps * 4


def wgmma_fp4_decode_smem_bytes(fmt: int, token_tile: int) -> int:
    """Dynamic shared memory of a decode_wgmma_*_fp4<fmt, token_tile> launch (the layout of
    decode_wgmma_fp4.cu's stages): 1024 to align the ring, then its stages, each the pass's
    rows (bf16, 128 k a k step), the weight rows' codes (64 bytes a k step) and their scale
    bytes (nvfp4 one a 16-code group, mxfp4 one a 32-code group)."""
    group = 16 if fmt == FORMAT_CODES["nvfp4"] else 32
    ksub = WGMMA_FP4_DECODE_KSUB
    stage = ksub * (token_tile * 128 * 2 + WGMMA_DECODE_ROWS * 64 + WGMMA_DECODE_ROWS * 128 // group)
    return 1024 + WGMMA_FP4_DECODE_STAGES * stage


def fp4_decode_mma_formats(mode: str, mxfp4_scale_bytes: Optional[tuple[int, int]] = None) -> tuple[int, ...]:
    """Format codes the decode path runs on tensor cores in `mode` (fp4_decode_mode): both
    fp4 formats, mxfp4 only when its scale bytes (smallest, largest) lie in
    FP4_MMA_MXFP4_SCALE_BYTES; none in "cores"."""
    if mode == "cores":
        return ()
    lo, hi = FP4_MMA_MXFP4_SCALE_BYTES
    mx_ok = mxfp4_scale_bytes is None or (lo <= mxfp4_scale_bytes[0] and mxfp4_scale_bytes[1] <= hi)
    return tuple(FORMAT_CODES[f] for f in FP4_DECODE_FORMATS if f != "mxfp4" or mx_ok)


# (BM, BK, STAGES) of the tensor-core grouped GEMMs: "stream" for few rows per expert
# (weights streaming: deep 64-wide K steps keep more bytes in flight), "math" for many
# (128-row tiles, shallow stages, fewer registers: two blocks per SM). NOTES.md has the data.
GROUPED_CONFIGS = {"stream": (64, 64, 4), "math": (128, 32, 3), "stream_q": (64, 32, 4)}
# quantized weights stream through "stream_q" instead of "stream": 32-wide K steps halve the
# shared memory (raw codes + bf16 tiles) and the registers, so more blocks per SM hide the
# conversion's latency (NOTES.md)
QUANT_CONFIG = {"stream": "stream_q", "math": "math"}
GROUPED_BN = 128  # cuda/grouped.cu GG_BN


def grouped_smem_bytes(bm: int, bk: int, stages: int, fmt: int = 0) -> int:
    """Dynamic shared memory of grouped_gemm<mode, bm, bk, stages, fmt>: the pipeline's
    stages; quantized formats keep two bf16 B tiles plus the raw code stages."""
    if fmt == 0:
        return stages * (bm + GROUPED_BN) * bk * 2
    bits = FORMAT_BITS[next(name for name, code in FORMAT_CODES.items() if code == fmt)]
    return stages * bm * bk * 2 + 2 * GROUPED_BN * bk * 2 + stages * GROUPED_BN * bk * bits // 8


# sort_place (cuda/grouped.cu): its block's first position of each local expert (int) and
# each warp's count of each (16 bits), for 32 warps
SORT_WARPS = 32


def sort_place_smem_bytes(n_local: int) -> int:
    return n_local * 4 + SORT_WARPS * n_local * 2


def expert_lists_smem_bytes(pairs: int, n_local: int) -> int:
    """build_expert_lists' shared memory (cuda/decode_common.cuh) for `pairs` <= 1024 pairs:
    the experts' counts, then starts, and a 16-bit count of each expert for each warp of
    pairs."""
    counts = -(-pairs // 32) * n_local  # 16-bit, two an int
    return (n_local + (counts + 1) // 2) * 4


SM90_BM, SM90_BK = 128, 64  # grouped_gemm_sm90's tile (cuda/grouped_sm90.cu)
GATHER_WARPS = 4  # the TMA kernel's gathering producer warps (cuda/grouped_sm90_tma.cu GATHER_WARPS)
TMA_A_BOX_ROWS = 64  # the TMA kernel's A boxes: one a warpgroup's rows (cuda/grouped_sm90_tma.cu TMA_SUB)
# weight formats the Hopper kernel also takes, dequantized into its B tiles: the fp4 ones
# (fp8 has the w8a8 kernel; its raw stages would not fit two blocks per SM)
SM90_QUANT_FORMATS = (FORMAT_CODES["nvfp4"], FORMAT_CODES["mxfp4"])


@dataclass(frozen=True)
class Sm90Variant:
    """One configuration of the Hopper bf16 grouped GEMM (cuda/grouped_sm90.cu, or
    cuda/grouped_sm90_tma.cu with TMA)."""
    stages: int
    blocks_per_sm: int
    bn: int  # weight rows per tile (gate/up: half gate, half up)
    tma: bool = False  # TMA copies from a producer warp; gate/up and down of bf16 weights only
    gather: bool = False  # (tma) gate/up's A rows gathered by the producer warps' cp.async, no xg
    wgs: int = 2  # (tma) consumer warpgroups, 64 rows each: 128- or 192-row tiles

    @property
    def bm(self) -> int:
        """Rows of a tile (the sort builds tiles of this height for it)."""
        return 64 * self.wgs if self.tma else SM90_BM

    def threads(self, mode: int = 0) -> int:
        """Two consumer warpgroups, and with TMA a producer warp (gate/up's gathering one: 4);
        three and no producer warp (one of theirs copies: cuda/grouped_sm90_tma.cu)."""
        if not self.tma:
            return 256
        if self.wgs == 3:
            return 384
        return 256 + 32 * (GATHER_WARPS if self.gather and mode == 0 else 1)

    def serves(self, fmt: int, mode: int = 0) -> bool:
        """bf16 weights, or fp4 ones dequantized into its B tiles (128-wide, cp.async);
        the TMA kernel serves bf16 gate/up and down, not the router."""
        if self.tma:
            return fmt == 0 and mode in (0, 1)
        return fmt == 0 or (fmt in SM90_QUANT_FORMATS and self.bn == GROUPED_BN)

    def kernel(self, mode: int, fmt: int = 0) -> str:
        if self.tma:
            gather = 1 if self.gather and mode == 0 else 0  # down reads act in order either way
            tail = f", {gather}, {self.wgs}" if self.wgs != 2 else f", {gather}" if gather else ""
            return f"grouped_gemm_sm90_tma<{mode}, {self.stages}, {self.bn}, {self.blocks_per_sm}{tail}>"
        tail = f", {fmt}" if fmt else ""
        return f"grouped_gemm_sm90<{mode}, {self.stages}, {self.blocks_per_sm}, {self.bn}{tail}>"

    def smem_bytes(self, fmt: int = 0) -> int:
        """The pipeline's stages (128-row A tiles, `bn`-row B tiles, 64 wide), fp4's raw
        code stages, the TMA kernel's 2 mbarriers a stage, and 1 KB to align the swizzle
        atoms."""
        raw = self.stages * self.bn * SM90_BK * 4 // 8 if fmt else 0
        bars = 16 * self.stages if self.tma else 0
        return self.stages * (self.bm + self.bn) * SM90_BK * 2 + raw + bars + 1024


# "deep": 6 stages at one block per SM (192 KB); "twin": 3 stages at two (one block's
# epilogue and prologue hide behind the other's math: 1.14-1.33x faster than deep at
# N = 4096 / 16384, NOTES.md v10); "wide": 128 x 256 tiles (twice the math per byte of A
# and of shared memory read; 128 accumulators a thread, so one block per SM): 5-20 %
# slower than twin (v11); "tma": twin's tiles and stages, loaded by TMA from a producer
# warp (v18: 1.07-1.19x twin where I >= 1536, slower at I = 512); "tma_wide": wide's tiles
# and stages loaded by TMA; "gather_wide": tma_wide whose gate/up producer (4 warps)
# gathers the A rows by cp.async instead of TMA reading them from xg (v24). A
# warp-specialized persistent cp.async kernel (v12) was slower than twin and is gone; so
# are 256 x 128 TMA tiles (v22: 1.1-1.6x slower on gate/up) and a gathering producer of
# one warp (v24: gate/up 1.2-1.3x slower than tma_wide). "tma_192": 192 x 256 tiles on
# three consumer warpgroups, one of whose threads issues the TMA copies (v26: the GEMMs
# run at L2's throughput, and 192-row tiles read 23 % fewer bytes a product); pairs of
# blocks sharing B by TMA multicast in 2-block clusters were 20-35 % slower (v26, branch
# exp/tma-pair-multicast); 192-row gate/up tiles whose consumers gather their A rows
# themselves were slower than gather_wide (v26, branch exp/gather-192).
SM90_VARIANTS = {
    "deep": Sm90Variant(6, 1, 128),
    "twin": Sm90Variant(3, 2, 128),
    "wide": Sm90Variant(4, 1, 256),
    "tma": Sm90Variant(3, 2, 128, tma=True),
    "tma_wide": Sm90Variant(4, 1, 256, tma=True),
    "gather_wide": Sm90Variant(4, 1, 256, tma=True, gather=True),
    "tma_192": Sm90Variant(4, 1, 256, tma=True, wgs=3),
}
# "auto" (the default). gate/up: "gather_wide" for layers whose routed experts'
# intermediate size is below GATHER_MAX_INTERMEDIATE, "tma_192" from it. Measured at N = 4096
# / 16384 (NOTES.md v24, results/20261130-h200-gather-s9c.txt): gather_wide's gate/up is
# 8 % faster than reading xg at I = 768 and 512 (qwen3-30b-a3b 513.7 -> 472.6 us at 4096,
# qwen3-next-80b 1752 -> 1633 at 16384): gather_rows' pass over P x H bytes weighs most
# where each gathered row feeds the fewest columns, and it outweighs what 192-row tiles save
# there (v26: qwen3-30b-a3b 470 -> 497 us at 4096). From I = 1536 192-row tiles (three
# warpgroups, 23 % fewer L2 bytes a product) are 2-14 % faster than tma_wide's 128 rows
# (v26, results/20261130-h200-tall-tiles-s10c.txt: deepseek-v3 gate/up 5591 -> 5209 us at
# 4096, 19569 -> 16744 at 16384; gpt-oss-120b 1667 -> 1508, 4923 -> 4559), within 1.5 %
# where they lose (qwen3-235b-a22b and mixtral-8x7b at 4096).
# down: "tma_192" below DOWN_192_MAX_INTERMEDIATE (8-14 % faster from N = 4096: qwen3-next-80b
# 1061-1069 -> 917-937 us at 16384, qwen3-30b-a3b 252 -> 242 at 4096), "tma_wide" from it:
# mixtral-8x7b's down (K = 14336, 16 column tiles) at N = 4096 makes 768 tiles of 192 rows,
# 5.8 waves of 132, against 1024 of 128 rows, and measured 1448 -> 1623 us.
GATHER_MAX_INTERMEDIATE = 1024
DOWN_192_MAX_INTERMEDIATE = 8192
AUTO_GATHER_VARIANT = "gather_wide"
AUTO_TMA_VARIANT = "tma_192"
AUTO_LONG_K_VARIANT = "tma_wide"


def _variant_env(name: str) -> str:
    v = os.environ.get(name, "auto")
    if v != "auto" and v not in SM90_VARIANTS:
        raise ValueError(f"{name}={v!r}: must be 'auto' or one of {sorted(SM90_VARIANTS)}")
    return v


def sm90_variant() -> str:
    """CUPYMOE_SM90_VARIANT: a name of SM90_VARIANTS, or "auto" (the default)."""
    return _variant_env("CUPYMOE_SM90_VARIANT")


def sm90_variant_for(intermediate: int, mode: int = 0) -> str:
    """The Hopper GEMM variant a layer with this routed intermediate size takes for gate/up
    (mode 0) or down (mode 1). CUPYMOE_SM90_VARIANT names one for both;
    CUPYMOE_SM90_DOWN_VARIANT one for down alone (measurements)."""
    v = sm90_variant()
    if v == "auto" and mode == 1:
        v = AUTO_TMA_VARIANT if intermediate < DOWN_192_MAX_INTERMEDIATE else AUTO_LONG_K_VARIANT
    elif v == "auto":
        v = AUTO_GATHER_VARIANT if intermediate < GATHER_MAX_INTERMEDIATE else AUTO_TMA_VARIANT
    if mode == 1:
        d = _variant_env("CUPYMOE_SM90_DOWN_VARIANT")
        if d != "auto":
            v = d
    return v


def sm90_kernel(mode: int, variant: str) -> str:
    return SM90_VARIANTS[variant].kernel(mode)


# grouped_gemm_sm90_fp8's tile: BM rows, BN weight rows (a gate/up tile covers BN / 2 = 128
# activation columns, one quantization group), BK bytes of K per stage, stages
SM90_FP8_TILE = (64, 256, 128, 4)


def sm90_fp8_smem_bytes() -> int:
    """grouped_gemm_sm90_fp8's stages of e4m3 A and B tiles, plus 1 KB to align them."""
    bm, bn, bk, st = SM90_FP8_TILE
    return st * (bm + bn) * bk + 1024


def grouped_kernel(mode: int, config: str, fmt: int = 0) -> tuple[str, int, int]:
    """(name expression, threads, dynamic smem bytes) of a grouped GEMM configuration."""
    bm, bk, st = GROUPED_CONFIGS[config]
    return f"grouped_gemm<{mode}, {bm}, {bk}, {st}, {fmt}>", 2 * bm, grouped_smem_bytes(bm, bk, st, fmt)


@dataclass(frozen=True)
class ModuleSpec:
    """One cuda/*.cu file and the kernels (template instances included) it provides."""

    file: str
    names: tuple[str, ...]
    archs: Optional[tuple[str, ...]] = None  # built only for these (None: every arch)

    def builds_for(self, arch: str) -> bool:
        return self.archs is None or arch in self.archs


MODULES: dict[str, ModuleSpec] = {
    "router": ModuleSpec(
        "router.cu", tuple(f"router_logits_bf16<{r}, {sp}>" for r in ROW_TILES for sp in ROUTER_SPLITS)
        + ("rmsnorm_bf16",)
    ),
    # the decode router on tensor cores, K split over a cluster (sm_90a: clusters)
    "router_mma": ModuleSpec("router_mma.cu", tuple(f"router_logits_mma<{nt}>" for nt in ROUTER_MMA_TILES),
                             archs=("sm_90a",)),
    # <1>: group-limited routers' rows from registers (routing.cuh route_row_topk)
    "topk": ModuleSpec("topk.cu", ("topk_route<0>", "topk_route<1>")),
    "grouped": ModuleSpec(
        "grouped.cu",
        ("sort_count", "sort_scan", "sort_place", "make_tiles", "grouped_reduce")
        + tuple(grouped_kernel(2, c)[0] for c in ("stream", "math"))  # the router: bf16
        + tuple(grouped_kernel(mode, c, 0)[0] for mode in (0, 1) for c in ("stream", "math"))
        + tuple(grouped_kernel(mode, c, f)[0] for mode in (0, 1) for c in ("stream_q", "math")
                for f in FORMAT_CODES.values() if f),
    ),
    "grouped_sm90": ModuleSpec("grouped_sm90.cu", tuple(dict.fromkeys(
        [v.kernel(m) for m in (0, 1, 2) for v in SM90_VARIANTS.values() if not v.tma]
        + [v.kernel(m, f) for m in (0, 1) for f in SM90_QUANT_FORMATS for v in SM90_VARIANTS.values() if v.serves(f)])),
                               archs=("sm_90a",)),
    "grouped_sm90_tma": ModuleSpec("grouped_sm90_tma.cu", tuple(dict.fromkeys(
        v.kernel(m) for m in (0, 1) for v in SM90_VARIANTS.values() if v.tma)) + ("gather_rows",),
                                   archs=("sm_90a",)),
    "grouped_sm90_fp8": ModuleSpec("grouped_sm90_fp8.cu",
                                   tuple(f"grouped_gemm_sm90_fp8<{m}>" for m in (0, 1)),
                                   archs=("sm_90a",)),
    "decode": ModuleSpec(
        "decode.cu",
        ("decode_build_lists", "decode_route_lists", "decode_topk_lists<0>", "decode_topk_lists<1>",
         "decode_reduce")
        + tuple(f"decode_gate_up<{r}, {c}, {f}>" for f in FORMAT_CODES.values() for r, c in GATE_UP_VARIANTS)
        + tuple(f"decode_down<{r}, {c}, {f}>" for f in FORMAT_CODES.values() for r, c in DOWN_VARIANTS),
    ),
    "decode_mma": ModuleSpec(
        "decode_mma.cu",
        tuple(f"decode_mma_{m}<{FORMAT_CODES[f]}, {ks}, {nt}>" for m in ("gate_up", "down")
              for f in MMA_DECODE_FORMATS for ks in MMA_DECODE_K_SPLITS for nt in MMA_DECODE_TOKEN_TILES)
        # down with two fragments a warp: only without a K split (layer._decode_kernel)
        + tuple(f"decode_mma_down<{FORMAT_CODES[f]}, 1, {nt}, 2>" for f in MMA_DECODE_FORMATS
                for nt in MMA_DECODE_TOKEN_TILES),
    ),
    # fp8-block decode as w8a8 (e4m3 MMAs, the layer's fp8_compute "w8a8", which it takes on
    # sm_90a): the same file's kernels on the activations' e4m3 codes
    "decode_mma_a8": ModuleSpec(
        "decode_mma.cu",
        tuple(f"decode_mma_{m}_a8<{ks}, {nt}>" for m in ("gate_up", "down")
              for ks in MMA_DECODE_K_SPLITS for nt in MMA_DECODE_TOKEN_TILES)
        + tuple(f"decode_mma_down_a8<1, {nt}, 2>" for nt in MMA_DECODE_TOKEN_TILES),
        archs=("sm_90a",),
    ),
    # ... and on wgmma e4m3 with the weights staged through shared memory (from a few rows
    # an expert on: layer._w8a8_decode_kernel)
    "decode_wgmma_a8": ModuleSpec(
        "decode_wgmma_a8.cu",
        tuple(f"decode_wgmma_{m}_a8<{nt}>" for m in ("gate_up", "down") for nt in WGMMA_DECODE_TOKEN_TILES),
        archs=("sm_90a",),
    ),
    # the fp4 device layout, made at load (cupymoe/weights.py: each code word's bits repacked)
    "repack": ModuleSpec("repack.cu", ("fp4_repack_words",)),
    # fp4 decode (W4A16) with the codes staged through shared memory and wgmma's A operand
    # dequantized in registers (layer._fp4_wgmma_decode_kernel)
    "decode_wgmma_fp4": ModuleSpec(
        "decode_wgmma_fp4.cu",
        tuple(f"decode_wgmma_{m}_fp4<{FORMAT_CODES[f]}, {nt}>" for m in ("gate_up", "down")
              for f in FP4_DECODE_FORMATS for nt in WGMMA_FP4_DECODE_TOKEN_TILES),
        archs=("sm_90a",),
    ),
}


from .errors import CudaUnavailableError, KernelBuildError  # noqa: F401 (re-exported)


def kernel_dir() -> Path:
    """cuda/ of the source tree, or cupymoe/cuda/ of an installed package."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda", here.parent / "cuda"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(f"cupymoe kernels not found next to {here} (looked in cuda/ and ../cuda/)")


def cache_dir() -> Path:
    d = os.environ.get("CUPYMOE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cupymoe")
    return Path(d)


# ----------------------------------------------------------------------------------
# NVRTC
# ----------------------------------------------------------------------------------

def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the install
        raise CudaUnavailableError(
            "CuPy is not installed: install cupymoe with the cu12 or cu13 extra "
            "(pip install 'cupymoe[cu12]')"
        ) from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())  # type: ignore[return-value]


def cuda_include_dirs() -> list[str]:
    """Where cuda_bf16.h lives: NVIDIA's PyPI headers first, then a local toolkit."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pf

        d = pf.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception as e:  # pathfinder absent or no pip headers: try the toolkit
        log.debug("cuda.pathfinder found no cudart headers: %s", e)
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(os.path.join(os.environ[env], "include"))
    dirs.append("/usr/local/cuda/include")
    found = [d for d in dirs if os.path.isfile(os.path.join(d, "cuda_bf16.h"))]
    if not found:
        raise KernelBuildError(
            "cuda_bf16.h not found: install the CUDA headers (pip install nvidia-cuda-runtime-cu12) "
            f"or set CUDA_PATH; looked in {dirs}"
        )
    return found[:1]


def parse_arch(arch: str) -> tuple[int, str]:
    """'sm_90a' -> (90, 'sm_90a'). Real architectures only: the cubin is what loads."""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", arch)
    if not m:
        raise ValueError(f"arch={arch!r}: expected a real architecture like sm_80 or sm_90a")
    cc = int(m.group(1))
    if cc < 80:
        raise ValueError(f"arch={arch!r}: cupymoe needs sm_80 or newer (bf16 tensor cores, cp.async)")
    return cc, arch


def arch_for_capability(major: int, minor: int) -> str:
    """The arch we compile for on a device: Hopper gets sm_90a so wgmma is available."""
    cc = major * 10 + minor
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def gemm_band_cols() -> Optional[int]:
    """CUPYMOE_GEMM_BAND_COLS: the grouped GEMMs' tile order in bands of this many column
    tiles (cuda/gemm_common.cuh, GEMM_BAND_COLS), a measurement knob; None: the default."""
    return positive_int_env("CUPYMOE_GEMM_BAND_COLS")


def compile_options(arch: str) -> tuple[str, ...]:
    cc, arch = parse_arch(arch)
    band = gemm_band_cols()
    return (
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "-default-device",  # unannotated functions (the epilogues' lambdas) are device code
        "-lineinfo",
        f"-DCUPYMOE_SM={cc}",
        *((f"-DGEMM_BAND_COLS={band}",) if band else ()),
        f"-I{kernel_dir()}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        "-Xptxas=-v",  # resource report in the program log (registers, spills, smem)
    )


@dataclass
class KernelResources:
    name: str  # the name expression, e.g. decode_gate_up<4>
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int
    uses_wgmma: bool


@dataclass
class CompiledModule:
    module: str
    arch: str
    cubin: bytes
    ptx: str
    lowered: dict[str, str]  # name expression -> mangled name
    log: str
    from_cache: bool = False
    _resources: Optional[list[KernelResources]] = field(default=None, repr=False)

    def resources(self) -> list[KernelResources]:
        """Per-kernel registers, spills, static shared memory and wgmma use, from ptxas -v."""
        if self._resources is None:
            self._resources = _parse_resources(self.log, self.ptx, self.lowered)
        return self._resources


def _source_digest(spec: ModuleSpec, options: Iterable[str], arch: str, version: tuple[int, int]) -> str:
    h = hashlib.sha256()
    kd = kernel_dir()
    h.update((kd / spec.file).read_bytes())
    for hdr in sorted(kd.glob("*.cuh")):  # every header any module could include
        h.update(hdr.name.encode())
        h.update(hdr.read_bytes())
    # include paths differ between machines but not the code they hold; key on the rest
    h.update(json.dumps([o for o in options if not o.startswith("-I")]).encode())
    h.update(arch.encode())
    h.update(repr(version).encode())
    h.update(json.dumps(spec.names).encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def compile_module(module: str, arch: str, *, use_cache: bool = True) -> CompiledModule:
    """Compile one cuda/ module for `arch` (no GPU needed), through the disk cache."""
    if module not in MODULES:
        raise KeyError(f"unknown kernel module {module!r}; known: {sorted(MODULES)}")
    spec = MODULES[module]
    nvrtc = _nvrtc()
    version = nvrtc_version()
    options = compile_options(arch)
    key = _source_digest(spec, options, arch, version)
    stem = cache_dir() / f"{module}-{arch}-{key[:20]}"
    if use_cache and stem.with_suffix(".json").is_file() and stem.with_suffix(".cubin").is_file():
        try:
            meta = json.loads(stem.with_suffix(".json").read_text())
            cubin = stem.with_suffix(".cubin").read_bytes()
            if meta.get("key") == key and len(cubin) == meta.get("cubin_len"):
                return CompiledModule(module, arch, cubin, meta["ptx"], meta["lowered"], meta["log"], True)
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable kernel cache entry %s: %s", stem, e)

    source = (kernel_dir() / spec.file).read_text()
    prog = nvrtc.createProgram(source, spec.file, (), ())
    try:
        for name in spec.names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise KernelBuildError(
                f"NVRTC failed on cuda/{spec.file} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}"
            ) from None
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in spec.names}
        plog = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        ptx = nvrtc.getPTX(prog)
        if isinstance(ptx, bytes):
            ptx = ptx.decode(errors="replace")
    finally:
        nvrtc.destroyProgram(prog)
    cm = CompiledModule(module, arch, cubin, ptx, lowered, plog)
    if use_cache:
        try:
            meta = {"key": key, "cubin_len": len(cubin), "ptx": ptx, "lowered": lowered, "log": plog}
            _atomic_write(stem.with_suffix(".cubin"), cubin)
            _atomic_write(stem.with_suffix(".json"), json.dumps(meta).encode())
        except OSError as e:  # a read-only home must not stop the layer
            log.warning("could not write kernel cache %s: %s", stem, e)
    return cm


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def _parse_resources(plog: str, ptx: str, lowered: dict[str, str]) -> list[KernelResources]:
    by_mangled: dict[str, dict] = {}
    cur = None
    for line in plog.splitlines():
        m = _RE_ENTRY.search(line)
        if m:
            cur = by_mangled.setdefault(m.group(1), {"regs": 0, "st": 0, "ld": 0, "stack": 0, "smem": 0})
            continue
        if cur is None:
            continue
        m = _RE_FRAME.search(line)
        if m:
            cur["stack"], cur["st"], cur["ld"] = (int(g) for g in m.groups())
        m = _RE_USED.search(line)
        if m:
            cur["regs"] = int(m.group(1))
            s = _RE_SMEM.search(line)
            cur["smem"] = int(s.group(1)) if s else 0
    # wgmma use, per entry, from the PTX bodies
    wgmma: dict[str, bool] = {}
    for m in re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx):
        start = m.end()
        nxt = ptx.find(".entry", start)
        wgmma[m.group(1)] = "wgmma.mma_async" in ptx[start: nxt if nxt >= 0 else len(ptx)]
    out = []
    for name, mangled in lowered.items():
        r = by_mangled.get(mangled, {"regs": -1, "st": 0, "ld": 0, "stack": 0, "smem": 0})
        out.append(KernelResources(name, r["regs"], r["st"], r["ld"], r["stack"], r["smem"], wgmma.get(mangled, False)))
    return out


def modules_for(arch: str) -> list[str]:
    return [m for m, spec in MODULES.items() if spec.builds_for(arch)]


def compile_modules(modules: Iterable[str], arch: str, *, use_cache: bool = True, jobs: Optional[int] = None,
                    progress=None) -> list[CompiledModule]:
    """compile_module for several modules side by side, results in the order asked. NVRTC
    releases the GIL while it compiles, so a thread a module suffices: all of sm_90a's took
    48 s on 2 cores where one after another took 110 (the same cubins); on the lent H200's
    16 cores a process a module took 33 s against 117-152 (NOTES.md v40). `jobs`: threads at
    most (default CUPYMOE_BUILD_JOBS, else the CPUs); `progress(cm, seconds)` hears each
    module as it is done. The first failure is raised."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    mods = list(modules)
    if jobs is None:
        jobs = positive_int_env("CUPYMOE_BUILD_JOBS") or os.cpu_count() or 1

    def one(m: str) -> CompiledModule:
        t0 = time.perf_counter()
        cm = compile_module(m, arch, use_cache=use_cache)
        if progress:
            progress(cm, time.perf_counter() - t0)
        return cm

    if jobs <= 1 or len(mods) <= 1:
        return [one(m) for m in mods]
    with ThreadPoolExecutor(max_workers=min(jobs, len(mods)), thread_name_prefix="nvrtc") as pool:
        return list(pool.map(one, mods))


def build_all(arch: str, *, use_cache: bool = True) -> list[CompiledModule]:
    return compile_modules(modules_for(arch), arch, use_cache=use_cache)


def format_report(modules: list[CompiledModule]) -> str:
    rows = [("module", "kernel", "regs", "spill st/ld", "stack", "static smem", "wgmma")]
    for cm in modules:
        for r in cm.resources():
            rows.append((cm.module, r.name, str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
                         str(r.stack_bytes), str(r.smem_bytes), "yes" if r.uses_wgmma else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Loading onto a device
# ----------------------------------------------------------------------------------

class KernelLibrary:
    """Every kernel of cuda/, compiled for one device and loaded, looked up by name expression.

    Construction compiles (or reads from the cache) and loads everything, so nothing is
    compiled inside a forward or during graph capture.
    """

    def __init__(self, device_id: int, modules: Optional[Iterable[str]] = None, progress=None):
        """`progress(line)`, when given, hears about each module as it is compiled or read
        from the cache (the first build takes tens of seconds; compile_modules builds the
        modules side by side)."""
        import cupy

        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
            self.arch = arch_for_capability(int(cc[:-1]), int(cc[-1]))
            # the most dynamic shared memory a block may opt in to
            self.max_smem = int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])
            self._functions: dict[str, object] = {}
            self._modules = []

            def heard(cm: CompiledModule, seconds: float) -> None:
                how = "from the cache" if cm.from_cache else f"compiled in {seconds:.1f} s"
                progress(f"kernels: {cm.module} for {self.arch} {how}")

            names = modules_for(self.arch) if modules is None else list(modules)
            for cm in compile_modules(names, self.arch, progress=heard if progress else None):
                mod = cupy.cuda.function.Module()
                mod.load(cm.cubin)
                self._modules.append(mod)  # keep the module alive as long as its functions
                for expr, mangled in cm.lowered.items():
                    fn = mod.get_function(mangled)
                    m = re.fullmatch(r"grouped_gemm<\d+, (\d+), (\d+), (\d+), (\d+)>", expr)
                    sm90 = next(((v, f) for v in SM90_VARIANTS.values() for mode in (0, 1, 2)
                                 for f in (0,) + SM90_QUANT_FORMATS if v.kernel(mode, f) == expr), None)
                    smem = (grouped_smem_bytes(*(int(g) for g in m.groups())) if m
                            else sm90_fp8_smem_bytes() if expr.startswith("grouped_gemm_sm90_fp8")
                            else sm90[0].smem_bytes(sm90[1]) if sm90
                            # sizes set per launch: sort_place's and decode_build_lists' by
                            # the layer's experts, the wgmma decode's by its K (less 1 KB: its
                            # static shared memory counts against the opt-in maximum too)
                            else self.max_smem if expr in ("sort_place", "decode_build_lists")
                            else self.max_smem - 1024 if expr.startswith("decode_wgmma_")
                            else 0)
                    if smem:  # opt in to more than 48 KB of dynamic shared memory, once
                        drv = cupy.cuda.driver
                        drv.funcSetAttribute(fn.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                    self._functions[expr] = fn

    def __getitem__(self, name: str):
        try:
            return self._functions[name]
        except KeyError:
            raise KeyError(f"kernel {name!r} is not in the library; known: {sorted(self._functions)}") from None


_LIBRARIES: dict[int, KernelLibrary] = {}


def library(device_id: int, progress=None) -> KernelLibrary:
    """The process-wide KernelLibrary of a device (compiled once, shared by every layer)."""
    lib = _LIBRARIES.get(device_id)
    if lib is None:
        lib = _LIBRARIES[device_id] = KernelLibrary(device_id, progress=progress)
    return lib
