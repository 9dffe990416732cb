"""What runs: the layer's static choices (LayerPlan) and a forward's launches (ForwardPlan).

A LayerPlan holds every choice that needs only the config, the weights' formats and sizes,
the knobs and the GPU's arch: made once when a layer is built (and by `python -m cupymoe
inspect` without a GPU). A ForwardPlan is what one forward enqueues: its ordered steps, each
launch with its kernel, grid, block, shared memory, PDL or not and its arguments by name.
Arguments name device buffers symbolically (Buf), the call's own pointers (CallValue) and
values of the row count (PerN), so one plan is pure data: a CPU test can build and read any
plan, and cupymoe/launch.py binds it to addresses once. cupymoe/forward_plan.py builds them.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Union

import numpy as np

from . import catalog as C
from .catalog import GemmMode, WeightFormat
from .config import MoeConfig, is_integer
from .errors import OptionError, PathUnavailableError, UnsupportedFormatError
from .knobs import (Bf16Decode, DecodeRouter, Fp4Decode, Fp8Decode, GateUpAhead, Knobs, L2Promotion, Sm90Fp8,
                    W8a8Decode)
from .tuning import TUNING, Choice, TunedBuckets, bucket_lookup, format_key, shape_key

log = logging.getLogger(__name__)


class Path(str, enum.Enum):
    """A forward path (DESIGN.md section 3)."""

    DECODE = "decode"  # a launch a stage for all rows, each chosen expert's weights read once
    ATOMIC = "atomic"  # decode, down accumulating with fp32 atomics (not bit-reproducible)
    PREFILL = "prefill"  # rows sorted by expert, grouped tensor-core GEMMs, a weighted reduce


PATH_NAMES = ("auto",) + tuple(p.value for p in Path)


class Stage(str, enum.Enum):
    """A forward's stages: each is an NVTX range and a CUPYMOE_PROFILE timing."""

    ROUTER = "router"
    TOPK = "topk"
    NORM = "norm"
    SORT = "sort"
    GATE_UP = "gate_up"
    DOWN = "down"
    REDUCE = "reduce"
    ALL_REDUCE = "all_reduce"


class Fp8Compute(str, enum.Enum):
    W8A8 = "w8a8"  # e4m3 tensor cores, activations quantized a row and 128 columns (sm_90a)
    W8A16 = "w8a16"  # weights dequantized to bf16 in registers


FP8_COMPUTE_NAMES = ("auto", "w8a8", "w8a16")


class Space(str, enum.Enum):
    """Where a named device buffer lives."""

    WEIGHTS = "weights"  # the layer's weights and per-slot tables (cupymoe/weights.py)
    SCRATCH = "scratch"  # the workspace the layer runs on (cupymoe/workspace.py)
    LAYER = "layer"  # the layer's own small state: error bits, tensor maps


class ArgType(enum.Enum):
    U64 = "u64"  # a pointer or 64-bit count
    I32 = "i32"
    F32 = "f32"


class CallValue(enum.Enum):
    """The values only a call knows."""

    INPUT = "x"
    OUTPUT = "out"
    TOKEN_IDS = "token_ids"
    LORA_IDS = "lora_ids"  # [N] int32 adapter slots, -1 = base (LoRA plans only)
    TOPK_IDS = "topk_ids"  # the experts-only entry's [N, k] int32 expert ids
    TOPK_WEIGHTS = "topk_weights"  # and its [N, k] float32 routing weights


class ErrorBit(enum.IntFlag):
    """The sticky error bits the kernels set (cuda/routing.cuh ERR_*, cuda/lora.cu; MoeLayer.check_errors)."""

    TOKEN_ID_RANGE = 1  # a token id outside 0..hash_vocab_size-1: the row got no routed experts
    EXPERT_ID_RANGE = 2  # forward_experts: an expert id outside 0..router_width-1: that pair got no expert
    LORA_ID_RANGE = 4  # a LoRA id outside -1..max_loras-1: the row got no delta (-1 is the base layer)
    ROUTER_NAN = 8  # NaN router scores or weights: a row got fewer than k experts (id -1, weight 0) or NaN weights


def error_text(flags: int) -> str:
    """What the set bits of a layer's error word mean, one clause a bit."""
    what = {ErrorBit.TOKEN_ID_RANGE: "a token id outside 0..hash_vocab_size-1 (those rows got no routed experts)",
            ErrorBit.EXPERT_ID_RANGE: "forward_experts: an expert id outside 0..router_width-1 (those pairs got no "
                                      "expert)",
            ErrorBit.LORA_ID_RANGE: "a LoRA id outside -1..max_loras-1 (those rows got no delta)",
            ErrorBit.ROUTER_NAN: "NaN router logits or weights, from NaN in x or an inf logit under softmax (those "
                                 "rows got fewer than k routed experts, or NaN weights)"}
    return "; ".join(f"bit {b.bit_length() - 1} = {text}" for b, text in what.items() if flags & b) or "unknown bits"


@dataclass(frozen=True)
class Buf:
    space: Space
    name: str

    def __str__(self) -> str:
        return f"{self.space.value}.{self.name}"


@dataclass(frozen=True)
class PerN:
    """A value of the call's row count N (the same name is the same function in one plan)."""

    name: str
    fn: Callable[[int], int] = field(compare=False, repr=False)

    def __str__(self) -> str:
        return f"<{self.name}>"


Value = Union[int, float, Buf, CallValue, PerN]


@dataclass(frozen=True)
class Arg:
    name: str
    type: ArgType
    value: Value


@dataclass(frozen=True)
class Launch:
    stage: Stage
    kernel: str  # a name expression of cupymoe/jit.py's MODULES
    grid: tuple
    block: tuple
    args: tuple[Arg, ...]
    smem: Union[int, PerN] = 0
    pdl: bool = False  # programmatic dependent launch (the kernel waits for the previous one itself)

    def arg(self, name: str) -> Value:
        for a in self.args:
            if a.name == name:
                return a.value
        raise KeyError(f"{self.kernel} has no argument {name!r}")


@dataclass(frozen=True)
class Memset:
    """Zero `words` 32-bit words of a buffer (the atomic path's accumulator)."""

    stage: Stage
    buffer: Buf
    words: Union[int, PerN]


@dataclass(frozen=True)
class AllReduce:
    """Sum the ranks' partial outputs in place (expert parallelism), on the forward's stream."""

    stage: Stage
    nbytes: Union[int, PerN]


Step = Union[Launch, Memset, AllReduce]


def _at(v, n: int):
    return v.fn(n) if isinstance(v, PerN) else v


@dataclass(frozen=True)
class ForwardPlan:
    """One forward's steps: on the decode paths for one row count, on prefill for every row count
    of one shape (`shape`: the launches are the same, their row-count values PerN)."""

    path: Optional[Path]
    steps: tuple[Step, ...]
    built_for: int  # the row count it was built for
    shape: Optional[object] = None  # forward_plan.PrefillShape of a prefill plan

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(s for s in self.steps if isinstance(s, Launch))

    def at(self, n: int) -> "ForwardPlan":
        """This plan with every row-count value evaluated at `n` rows."""
        steps = []
        for s in self.steps:
            if isinstance(s, Launch):
                s = replace(s, grid=tuple(_at(g, n) for g in s.grid), smem=_at(s.smem, n),
                            args=tuple(replace(a, value=_at(a.value, n)) for a in s.args))
            elif isinstance(s, Memset):
                s = replace(s, words=_at(s.words, n))
            else:
                s = replace(s, nbytes=_at(s.nbytes, n))
            steps.append(s)
        return replace(self, steps=tuple(steps), built_for=n)

    def describe(self) -> str:
        """The launches as text, one a line (kernel, grid, block, shared memory, PDL)."""
        serves = f"N = {self.built_for}" if self.shape is None else f"every N of {self.shape}"
        lines = [f"{self.path.value if self.path else '-'} plan for {serves}:"]
        for s in self.steps:
            if isinstance(s, Launch):
                grid = "x".join(str(g) for g in s.grid)
                lines.append(f"  {s.stage.value:<10} {s.kernel:<48} grid {grid:<18} block {s.block[0]:<4} "
                             f"smem {s.smem}{' pdl' if s.pdl else ''}")
            else:
                lines.append(f"  {s.stage.value:<10} {type(s).__name__}")
        return "\n".join(lines)


@dataclass(frozen=True)
class DeviceFacts:
    """What the plans need of a GPU."""

    arch: str  # the arch the kernels are compiled for, e.g. "sm_90a"
    sm_count: int
    max_smem: int  # dynamic shared memory a block may opt in to
    name: str = ""  # as the driver reports it: the tuning table's by_device section it takes ("": none)

    @classmethod
    def h200(cls) -> "DeviceFacts":
        """The H200 the tuning table was measured on (for plans built without a GPU)."""
        return cls("sm_90a", 132, 232448)

    @property
    def hopper(self) -> bool:
        return self.arch == "sm_90a"


@dataclass(frozen=True)
class LayerPlan:
    """Every choice a layer makes before its first forward, from the config, its weights'
    formats and sizes, the knobs and the arch."""

    cfg: MoeConfig
    n_local: int  # routed experts on this GPU (table slots 0..n_local-1; the shared expert is slot n_local)
    i_max: int  # the largest intermediate size of its experts
    routed_format: WeightFormat
    shared_format: Optional[WeightFormat]
    decode_max_tokens: int  # rows the decode and atomic paths serve (their scratch is sized for it)
    atomic_max_tokens: int
    row_invariant: bool
    formats: tuple[WeightFormat, ...]  # the expert kernels run once a format present
    fp8_compute: Optional[Fp8Compute]  # fp8-block experts' compute; None without them
    sm90: Mapping[GemmMode, C.Sm90Variant]  # the Hopper GEMM variant of gate/up, down, the router
    gathers_rows: bool  # gate/up on TMA reads its inputs gathered into xg
    math_rows: int  # rows per expert from which the grouped GEMMs take 128-row tiles
    w8a8_shared_x: bool  # an fp8 shared expert behind a pre-expert norm: x gets its own e4m3 copy
    mma_decode_formats: tuple[WeightFormat, ...]  # formats whose decode runs on tensor cores
    fp4_decode: Fp4Decode
    fp4_wgmma_ok: bool  # every K the fp4 wgmma decode reads is a multiple of 128 (and sm_90a)
    w8a8_decode: W8a8Decode
    mma_blocks_per_sm: int
    mma_down_pairs: bool
    fp4_down_tiles: Optional[int]  # forced by CUPYMOE_FP4_DOWN_TILES
    a8_down_tiles: Optional[int]  # forced by CUPYMOE_A8_DOWN_TILES
    topk_lists: bool
    decode_sort_pairs: int  # the decode and atomic paths' one-block sort up to this many pairs
    decode_router: DecodeRouter  # resolved for the arch (tensor cores need sm_90a)
    pdl: bool  # resolved for the arch (sm_90+)
    all_reduce: bool  # expert parallelism with a communicator: the partials are summed last
    auto_decode_max: int  # auto takes decode up to this many rows where the table has no entry
    tuned: TunedBuckets = ()  # the tuning table's measured choices for this shape and format
    decode_kernel: Bf16Decode = Bf16Decode.AUTO  # CUPYMOE_DECODE_KERNEL
    gate_up_ahead: GateUpAhead = GateUpAhead.AUTO  # CUPYMOE_GATE_UP_AHEAD
    swapab_ok: bool = False  # sm_90a, not row-invariant, every expert bf16 or fp8-block as w8a8: swap-AB may serve
    sm90_fp8: Sm90Fp8 = Sm90Fp8.AUTO  # CUPYMOE_SM90_FP8_VARIANT
    fp8_tma_ok: bool = False  # w8a8 with every fp8 K and row pitch a multiple of 16 bytes: the TMA GEMM may serve
    # w8a8: the grouped gate/up also stores the bf16 activation, which no kernel reads (verify.W8a8Stages does)
    keep_w8a8_activation: bool = False
    weight_l2_promotion: L2Promotion = L2Promotion.B128  # the weight tensor maps' (CUPYMOE_WEIGHT_L2_PROMOTION)
    # prefill rows up to which the router's LoRA t comes from the router GEMM (0: none; set where the
    # layer reserves adapter slots, forward_plan.lora_router_t_rows)
    lora_router_t_rows: int = 0

    @property
    def fp8_tma_chosen(self) -> bool:
        """Whether some N of this plan runs the w8a8 TMA GEMM (the layer then encodes its maps)."""
        return any(self._runs_somewhere(self.fp8_tma_ok, self.sm90_fp8, form, "sm90_fp8")
                   for form in (Sm90Fp8.TMA, Sm90Fp8.TMA64))

    def _runs_somewhere(self, ok: bool, knob, on, field: str) -> bool:
        """Whether a kernel that may serve (`ok`) runs at some N: its knob set to `on`, or left
        at auto with a table row whose `field` names it (`on`'s value)."""
        return ok and (knob == on or (knob.value == "auto" and any(getattr(c, field) == on.value
                                                                     for _, c in self.tuned)))

    @property
    def swapab_chosen(self) -> bool:
        """Whether some N of this plan runs the swap-AB decode (the layer then encodes its tensor maps)."""
        return self._runs_somewhere(self.swapab_ok, self.decode_kernel, Bf16Decode.SWAPAB, "decode_kernel")

    def choice(self, n: int) -> Choice:
        """The table's choice for a forward of `n` rows (Choice() where it has none)."""
        return bucket_lookup(self.tuned, n) or Choice()

    @property
    def w8a8(self) -> bool:
        return self.fp8_compute == Fp8Compute.W8A8

    @property
    def tma(self) -> bool:
        """Whether gate/up or down runs on the TMA kernel (the layer then has tensor maps)."""
        return bool(self.sm90[GemmMode.GATE_UP].tma or self.sm90[GemmMode.DOWN].tma)

    @property
    def has_shared(self) -> int:
        return 1 if self.cfg.has_shared_expert else 0


def lora_options(options: LayerOptions) -> LayerOptions:
    """The options of a w8a8 layer's LoRA forwards with expert adapters: its fp8 experts as w8a16 (the
    deltas go into g and u before the activation, which the w8a8 gate/up quantizes in its epilogue); the
    table's w8a16 rows choose their paths (tests/test_gpu_lora.py checks the LoRA decode to 769 rows)."""
    return replace(options, fp8_compute=Fp8Compute.W8A16.value, keep_w8a8_activation=False)


def resolve_fp8_compute(fp8_compute: str, formats: tuple[WeightFormat, ...], arch: str) -> Optional[Fp8Compute]:
    """fp8-block experts: w8a8 (e4m3 tensor cores) on sm_90a unless w8a16 is asked for."""
    if fp8_compute not in FP8_COMPUTE_NAMES:
        raise OptionError(f"fp8_compute={fp8_compute!r}: must be one of {FP8_COMPUTE_NAMES}")
    if WeightFormat.FP8_BLOCK not in formats:
        if fp8_compute == "w8a8":
            raise UnsupportedFormatError("fp8_compute='w8a8' needs fp8_block experts; this layer's are "
                                         f"{[f.label for f in formats]}")
        return None
    if arch != "sm_90a":
        if fp8_compute == "w8a8":
            raise UnsupportedFormatError(f"fp8_compute='w8a8' needs sm_90a (wgmma e4m3); this device is "
                                         f"{arch}: use fp8_compute='w8a16'")
        return Fp8Compute.W8A16
    return Fp8Compute.W8A16 if fp8_compute == "w8a16" else Fp8Compute.W8A8


def sm90_variant_for(intermediate: int, mode: GemmMode, knobs: Knobs) -> str:
    """The Hopper GEMM variant for gate/up or down of a layer of this routed intermediate size."""
    auto = TUNING.sm90_auto
    v = knobs.sm90_variant
    if v == "auto" and mode == GemmMode.DOWN:
        v = auto.down if intermediate < auto.down_192_max_intermediate else auto.down_long_k
    elif v == "auto":
        v = auto.gate_up_gather if intermediate < auto.gather_max_intermediate else auto.gate_up
    if mode == GemmMode.DOWN and knobs.sm90_down_variant != "auto":
        v = knobs.sm90_down_variant
    return v


def _sm90_plan(cfg: MoeConfig, formats: tuple[WeightFormat, ...], arch: str, row_invariant: bool,
               knobs: Knobs) -> dict[GemmMode, C.Sm90Variant]:
    """The Hopper GEMM of gate/up, down and the router: the TMA kernel serves bf16 experts only
    (others take twin's tiles by cp.async); the router keeps the cp.async kernel."""
    variants = TUNING.sm90_variants
    sm90 = {m: variants[sm90_variant_for(cfg.moe_intermediate_size, m, knobs)]
            for m in (GemmMode.GATE_UP, GemmMode.DOWN)}
    twin = variants["twin"]
    tma_ok = arch == "sm_90a" and not row_invariant and all(variants["tma"].serves(f, 0) for f in formats)
    sm90 = {m: twin if v.tma and not tma_ok else v for m, v in sm90.items()}
    sm90[GemmMode.ROUTER] = twin if sm90[GemmMode.GATE_UP].tma else sm90[GemmMode.GATE_UP]
    return sm90


def mma_decode_formats(knobs: Knobs, mxfp4_scale_bytes: Optional[tuple[int, int]]) -> tuple[WeightFormat, ...]:
    """Formats the decode path runs on tensor cores: fp4 (mxfp4 only where its scale bytes lie in
    the served range) unless CUPYMOE_FP4_DECODE=cores, fp8 unless CUPYMOE_FP8_DECODE=cores."""
    out: tuple[WeightFormat, ...] = ()
    if knobs.fp4_decode != Fp4Decode.CORES:
        lo, hi = C.FP4_MMA_MXFP4_SCALE_BYTES
        mx_ok = mxfp4_scale_bytes is None or (lo <= mxfp4_scale_bytes[0] and mxfp4_scale_bytes[1] <= hi)
        out = tuple(f for f in C.FP4_DECODE_FORMATS if f != WeightFormat.MXFP4 or mx_ok)
    if knobs.fp8_decode == Fp8Decode.MMA:
        out += (WeightFormat.FP8_BLOCK,)
    return out


def tuned_buckets(cfg: MoeConfig, routed: WeightFormat, n_local: int, w8a8: bool, knobs: Knobs,
                  row_invariant: bool, table=None, device: str = "") -> TunedBuckets:
    """The tuning table's entries for this layer's shape and format on the GPU named `device` (its
    by_device rows over the table's, unless CUPYMOE_DEVICE_ROWS=0), less what a knob forces; none for
    row-invariant layers (every N runs the grouped path's instructions)."""
    if row_invariant:
        return ()
    key = (shape_key(cfg.hidden_size, cfg.moe_intermediate_size, n_local, cfg.num_experts, cfg.num_experts_per_tok,
                     cfg.shared_expert_intermediate_size), format_key(routed.label, w8a8))
    found = TUNING.rows_for(key, device if knobs.device_rows else "") if table is None else table.get(key, ())
    drop = {"grouped": knobs.math_rows is not None, "w8a8_decode": knobs.w8a8_decode != W8a8Decode.AUTO,
            "decode_kernel": knobs.decode_kernel != Bf16Decode.AUTO, "sm90_fp8": knobs.sm90_fp8_variant != Sm90Fp8.AUTO}
    drop["sm90_gate_up"] = knobs.sm90_variant != "auto"
    drop["sm90_down"] = knobs.sm90_variant != "auto" or knobs.sm90_down_variant != "auto"

    def kept(c: Choice) -> Choice:
        # a token tile goes with the table's choice of the kernels it sizes (swap-AB, or the w8a8 wgmma decode)
        owner = "decode_kernel" if c.decode_kernel == "swapab" else "w8a8_decode"
        gone = {f for f, d in drop.items() if d} | ({"token_tile"} if drop[owner] else set())
        return replace(c, **{f: None for f in gone})

    return tuple((b, kept(c)) for b, c in found)


def _path_caps(tuned: TunedBuckets, options: "LayerOptions", default_dmax: int) -> tuple[int, int]:
    """(decode, atomic) row caps: the options', else the global ones raised to the table's decode-path buckets."""
    dmax, amax = options.decode_max_tokens, options.atomic_max_tokens
    if dmax is None:
        dmax = max([default_dmax] + [b for b, c in tuned if c.path in ("decode", "atomic")])
    if amax is None:
        amax = max([TUNING.atomic_max_tokens] + [b for b, c in tuned if c.path == "atomic"])
    return max(1, int(dmax)), int(amax)


@dataclass(frozen=True)
class LayerOptions:
    """The keyword options of MoeLayer that shape its plans (validated by plan_layer)."""

    row_invariant: bool = False
    fp8_compute: str = "auto"
    decode_max_tokens: Optional[int] = None
    atomic_max_tokens: Optional[int] = None
    all_reduce: bool = False
    keep_w8a8_activation: bool = False  # MoeLayer(keep_w8a8_activation=True): LayerPlan.keep_w8a8_activation

    def __post_init__(self):
        for name in ("row_invariant", "all_reduce", "keep_w8a8_activation"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name}={getattr(self, name)!r}: must be True or False")
        for name, least in (("decode_max_tokens", 1), ("atomic_max_tokens", 0)):
            v = getattr(self, name)
            if v is not None and (not is_integer(v) or v < least):
                raise OptionError(f"{name}={v!r}: must be a whole number of rows, at least {least} (None: the "
                                  "measured crossover)")
        if (self.decode_max_tokens is not None and self.atomic_max_tokens is not None
                and self.atomic_max_tokens > self.decode_max_tokens):
            raise OptionError(f"atomic_max_tokens={self.atomic_max_tokens} exceeds decode_max_tokens="
                              f"{self.decode_max_tokens}: the atomic path is the decode path's variant, "
                              "for at most as many rows")


def plan_layer(cfg: MoeConfig, routed_format: str, shared_format: Optional[str], arch: str, *,
               n_local: Optional[int] = None, options: LayerOptions = LayerOptions(),
               knobs: Optional[Knobs] = None, mxfp4_scale_bytes: Optional[tuple[int, int]] = None,
               table=None, device_name: str = "") -> LayerPlan:
    """A layer's choices for routed experts of `routed_format` (and a shared expert of
    `shared_format`, None without one) on a GPU the kernels are compiled for as `arch`, named
    `device_name` (the tuning table's rows timed on that model, where it has some);
    `table`: per-shape entries in place of the tuning table's (tests)."""
    knobs = knobs or Knobs.from_env()
    routed = WeightFormat.named(routed_format)
    shared = WeightFormat.named(shared_format) if shared_format else None
    formats = tuple(dict.fromkeys([routed] + ([shared] if shared is not None else [])))
    fp8 = resolve_fp8_compute(options.fp8_compute, formats, arch)
    auto_dmax = options.decode_max_tokens
    swapab_ok = swapab_serves(formats, fp8, arch, options.row_invariant)
    auto_dmax = max(1, int(_default_decode_max(routed, knobs, swapab_ok) if auto_dmax is None else auto_dmax))
    n_local = cfg.experts_per_rank if n_local is None else int(n_local)
    # the package table's per-shape rows were measured on one arch and name its kernels: elsewhere, the rules
    measured_here = table is not None or arch == TUNING.by_shape_arch
    tuned = (tuned_buckets(cfg, routed, n_local, fp8 == Fp8Compute.W8A8, knobs, options.row_invariant, table,
                           device_name) if measured_here else ())
    if swapab_ok and knobs.decode_kernel == Bf16Decode.SWAPAB:  # the table's paths were measured without it
        # (with the prefill GEMM variants a bucket's path brought: they need path='prefill')
        tuned = tuple((b, replace(c, path=None, sm90_gate_up=None, sm90_down=None) if b <= C.SWAPAB_MAX_ROWS else c)
                      for b, c in tuned)
    dmax, amax = _path_caps(tuned, options, auto_dmax)
    sm90 = _sm90_plan(cfg, formats, arch, options.row_invariant, knobs)
    hopper = arch == "sm_90a" and not options.row_invariant
    wgmma = hopper and sm90[GemmMode.GATE_UP].serves(routed)
    i_max = max(cfg.moe_intermediate_size if n_local else 0, cfg.shared_expert_intermediate_size)
    fp4_ks = _fp4_ks(cfg, routed, shared)
    cc = int(re.match(r"sm_(\d+)", arch).group(1))
    lp = LayerPlan(
        cfg=cfg, n_local=n_local, i_max=i_max,
        routed_format=routed, shared_format=shared, decode_max_tokens=dmax,
        atomic_max_tokens=min(amax, dmax), row_invariant=bool(options.row_invariant), formats=formats,
        fp8_compute=fp8, sm90=sm90, gathers_rows=bool(sm90[GemmMode.GATE_UP].tma and not sm90[GemmMode.GATE_UP].gather),
        math_rows=knobs.math_rows or TUNING.math_rows_per_expert["wgmma" if wgmma else "mma"],
        w8a8_shared_x=fp8 == Fp8Compute.W8A8 and shared == WeightFormat.FP8_BLOCK and cfg.pre_expert_norm,
        mma_decode_formats=mma_decode_formats(knobs, mxfp4_scale_bytes), fp4_decode=knobs.fp4_decode,
        fp4_wgmma_ok=arch == "sm_90a" and all(K % 128 == 0 for K in fp4_ks), w8a8_decode=knobs.w8a8_decode,
        mma_blocks_per_sm=knobs.mma_blocks_per_sm, mma_down_pairs=knobs.mma_down_pairs,
        fp4_down_tiles=knobs.fp4_down_tiles, a8_down_tiles=knobs.a8_down_tiles, topk_lists=knobs.topk_lists,
        decode_sort_pairs=knobs.decode_sort_pairs or C.DECODE_SORT_PAIRS,
        decode_router=knobs.decode_router if arch == "sm_90a" else DecodeRouter.CORES,
        pdl=knobs.pdl and cc >= 90, all_reduce=bool(options.all_reduce), auto_decode_max=auto_dmax, tuned=tuned,
        decode_kernel=knobs.decode_kernel, gate_up_ahead=knobs.gate_up_ahead, swapab_ok=swapab_ok,
        sm90_fp8=knobs.sm90_fp8_variant,
        weight_l2_promotion=knobs.weight_l2_promotion,
        fp8_tma_ok=fp8 == Fp8Compute.W8A8 and _fp8_tma_fits(cfg, routed, shared, i_max),
        keep_w8a8_activation=fp8 == Fp8Compute.W8A8 and options.keep_w8a8_activation,
    )
    if options.atomic_max_tokens is not None and options.atomic_max_tokens > lp.atomic_max_tokens:
        log.warning("atomic_max_tokens=%d exceeds the layer's decode cap: the atomic path serves at most %d rows",
                    options.atomic_max_tokens, lp.atomic_max_tokens)
    for note in unserved_knobs(lp, arch, knobs):
        if note not in _LOGGED:  # once a process: a model's layers, a bench's copies share their notes
            _LOGGED.add(note)
            log.warning("%s", note)
    return lp


_LOGGED: set[str] = set()


def unserved_knobs(lp: LayerPlan, arch: str, knobs: Knobs) -> list[str]:
    """The forced knobs this layer cannot take, each a line saying what runs instead (a sweep setting a
    knob over several presets runs on; its log says where the knob did not apply)."""
    fp4 = [f for f in lp.formats if f.is_fp4]
    notes = []
    if lp.decode_kernel == Bf16Decode.SWAPAB and not lp.swapab_ok:
        notes.append(f"CUPYMOE_DECODE_KERNEL=swapab: the swap-AB decodes serve bf16 and fp8 as w8a8 on sm_90a, not "
                     f"this layer ({'/'.join(f.label for f in lp.formats)}, {arch}): the formats' own decode kernels run")
    if knobs.decode_router in (DecodeRouter.MMA, DecodeRouter.SPLIT) and lp.decode_router != knobs.decode_router:
        notes.append(f"CUPYMOE_DECODE_ROUTER={knobs.decode_router.value}: the tensor-core router is sm_90a's, not "
                     f"{arch}'s: the CUDA cores route")
    if lp.fp4_decode == Fp4Decode.WGMMA and fp4 and not lp.fp4_wgmma_ok:
        ks = sorted(set(_fp4_ks(lp.cfg, lp.routed_format, lp.shared_format)))
        notes.append(f"CUPYMOE_FP4_DECODE=wgmma: decode_wgmma_fp4 needs sm_90a and every fp4 K a multiple of 128 "
                     f"({arch}, K = {ks}): decode_mma runs")
    if lp.sm90_fp8 != Sm90Fp8.AUTO and not (lp.w8a8 and (lp.sm90_fp8 == Sm90Fp8.CP_ASYNC or lp.fp8_tma_ok)):
        notes.append(f"CUPYMOE_SM90_FP8_VARIANT={lp.sm90_fp8.value}: the layer's w8a8 GEMMs cannot take it (fp8_compute="
                     f"{lp.fp8_compute.value if lp.fp8_compute else None}, the TMA forms' K and pitches: "
                     f"{lp.fp8_tma_ok}): the cp.async GEMM or none runs")
    for name, count, takes in (("CUPYMOE_A8_DOWN_TILES", lp.a8_down_tiles, lp.w8a8),
                               ("CUPYMOE_FP4_DOWN_TILES", lp.fp4_down_tiles, bool(fp4) and lp.fp4_wgmma_ok)):
        if takes and count is not None and C.forced_down_tiles(count, lp.cfg.hidden_size) != count:
            notes.append(f"{name}={count}: it does not divide H / 128 (H={lp.cfg.hidden_size}): one tile a block")
    if lp.fp4_down_tiles is not None and fp4 and not lp.fp4_wgmma_ok:
        notes.append(f"CUPYMOE_FP4_DOWN_TILES={lp.fp4_down_tiles}: the fp4 wgmma decode does not run here ({arch}): "
                     "nothing takes it")
    return notes


def swapab_serves(formats: tuple[WeightFormat, ...], fp8: Optional[Fp8Compute], arch: str,
                   row_invariant: bool) -> bool:
    """Whether the swap-AB decode may serve a layer: sm_90a (wgmma, TMA), not row-invariant (its
    sums differ from the grouped path's), and every expert bf16 (decode_swapab_sm90.cu) or
    fp8-block as w8a8 (decode_swapab_fp8_sm90.cu, on the activations' e4m3 codes)."""
    served = {WeightFormat.BF16} | ({WeightFormat.FP8_BLOCK} if fp8 == Fp8Compute.W8A8 else set())
    return arch == "sm_90a" and not row_invariant and set(formats) <= served


def _fp4_ks(cfg: MoeConfig, routed: WeightFormat, shared: Optional[WeightFormat]) -> list[int]:
    """The K sizes decode_wgmma_fp4 reads: H (gate/up), and I of each fp4 expert kind (down)."""
    return [cfg.hidden_size] + [i for f, i in ((routed, cfg.moe_intermediate_size),
                                               (shared, cfg.shared_expert_intermediate_size))
                                if f is not None and f.is_fp4]


def _fp8_tma_fits(cfg: MoeConfig, routed: WeightFormat, shared: Optional[WeightFormat], i_max: int) -> bool:
    """Whether the w8a8 TMA GEMM can read every fp8 matrix of the layer: TMA rows (the weights'
    K, the activation codes' I and their I_max pitch, x's gathered H) in whole 16-byte units."""
    ks = [cfg.hidden_size, i_max] + [i for f, i in ((routed, cfg.moe_intermediate_size),
                                                    (shared, cfg.shared_expert_intermediate_size))
                                     if f == WeightFormat.FP8_BLOCK and i]
    return all(k % 16 == 0 for k in ks)


def _default_decode_max(routed: WeightFormat, knobs: Knobs, swapab_ok: bool) -> int:
    """Rows auto takes the decode path up to: the tuning table's for the format, or with
    CUPYMOE_DECODE_KERNEL=swapab (where it serves) the swap-AB decode's SWAPAB_MAX_ROWS."""
    dmax = int(TUNING.decode_max_tokens.get(routed.label, TUNING.decode_max_tokens["bf16"]))
    if swapab_ok and knobs.decode_kernel == Bf16Decode.SWAPAB:
        dmax = max(dmax, C.SWAPAB_MAX_ROWS)
    return dmax


def _auto_path(lp: LayerPlan, n: int) -> str:
    """The table's path where it has one the layer's caps admit, else decode up to auto_decode_max rows."""
    if lp.row_invariant:
        return "prefill"
    tuned = lp.choice(n).path
    caps = {"decode": lp.decode_max_tokens, "atomic": lp.atomic_max_tokens, "prefill": n}
    if tuned is not None and n <= caps[tuned]:
        return tuned
    return "prefill" if n > min(lp.auto_decode_max, lp.decode_max_tokens) else "decode"


def choose_path(lp: LayerPlan, path: str, num_tokens: int) -> str:
    """The path a forward of `num_tokens` rows takes when `path` ("auto" or a forced one) is asked."""
    if not isinstance(path, str) or path not in PATH_NAMES:  # an array's `in` would raise ValueError
        raise PathUnavailableError(f"path={path!r}: must be one of {PATH_NAMES}")
    if path == "auto":
        return _auto_path(lp, num_tokens)
    if lp.row_invariant and path != "prefill":
        raise PathUnavailableError(f"path={path!r} with row_invariant=True: row-invariant layers run the grouped "
                                   "path at every N, so a row's bits do not depend on N or on the path; use "
                                   "path='auto' or 'prefill'")
    if path in ("decode", "atomic") and num_tokens > lp.decode_max_tokens:
        raise PathUnavailableError(f"path={path!r} serves num_tokens <= decode_max_tokens={lp.decode_max_tokens}, "
                                   f"got {num_tokens} (its scratch is sized for that; raise decode_max_tokens at "
                                   "construction)")
    if path == "atomic" and num_tokens > lp.atomic_max_tokens:
        raise PathUnavailableError(f"path='atomic' serves num_tokens <= {lp.atomic_max_tokens} (atomic_max_tokens), "
                                   f"got {num_tokens}")
    return path
