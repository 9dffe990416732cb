"""Every CUPYMOE_* environment knob, in one table: read once, validated, documented.

A layer reads `Knobs.from_env()` once when it is built (a bad value is refused there, before
anything is uploaded, never during a forward); the compiler reads the build knobs when it
compiles. `python -m cupymoe knobs` prints the table. Measurement knobs force one choice of
the dispatch for tests and benchmarks; the defaults are what the layer uses in service.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, fields
from typing import Callable, Mapping, Optional

from .errors import OptionError


class Fp4Decode(str, enum.Enum):
    AUTO = "auto"  # wgmma where its grid fills enough of a wave, mma below
    MMA = "mma"
    WGMMA = "wgmma"
    CORES = "cores"  # decode.cu's CUDA-core readers


class Fp8Decode(str, enum.Enum):
    MMA = "mma"  # tensor cores (decode_mma.cu)
    CORES = "cores"


class W8a8Decode(str, enum.Enum):
    AUTO = "auto"
    MMA = "mma"
    WGMMA = "wgmma"


class Bf16Decode(str, enum.Enum):
    AUTO = "auto"  # the tuning table's choice for the shape and N bucket, else register
    REGISTER = "register"  # decode.cu's CUDA-core streams
    SWAPAB = "swapab"  # decode_swapab_sm90.cu, fp8 as w8a8: _fp8_sm90.cu (sm_90a; decode up to SWAPAB_MAX_ROWS rows)


class Sm90Fp8(str, enum.Enum):
    AUTO = "auto"  # the tuning table's choice for the shape and N bucket, else cp_async
    CP_ASYNC = "cp_async"  # grouped_sm90_fp8.cu: 64 x 256 tiles, every thread copies
    TMA = "tma"  # grouped_sm90_fp8_tma.cu: 128 x 256 tiles, TMA and a producer warpgroup
    TMA64 = "tma64"  # ... its 64 x 256 tiles, one consumer warpgroup, two blocks an SM


class L2Promotion(str, enum.Enum):
    """How far the L2 widens a TMA box row's DRAM read (CUtensorMapL2promotion)."""
    NONE = "none"
    B64 = "64"
    B128 = "128"
    B256 = "256"


class LoraShrink(str, enum.Enum):
    """How the stacked form makes T (forward_plan._stacked_gemm)."""
    AUTO = "auto"  # heuristics.lora_shrink_form: segments past LORA_SEGMENTS_FROM_ROWS rows, below experts or chunks by K
    CHUNKS = "chunks"  # lora_stack_t_gate_up / _down: a tile's rows bucketed by adapter, a chunk's shrink at a time
    SEGMENTS = "segments"  # lora_stack_t_seg: a block a (tile, adapter), its rows against that adapter's A rows, pipelined
    EXPERTS = "experts"  # lora_stack_t_seg_experts: the same a (expert piece, adapter), A read once for each 64 of its rows


class LoraDownSplit(str, enum.Enum):
    """What lora_down_delta's blocks of one pair split (cuda/lora.cu: by_cols; forward_plan.lora_down_cols)."""
    COLS = "cols"  # the expand's H output columns, each block the pair's whole shrink
    SHRINK = "shrink"  # the shrink's I input columns, the slices meeting at a ticket, the last block expanding


class GateUpAhead(str, enum.Enum):
    """Whether the decode gate/up's blocks go by table slot, their first weight stages copied
    before they wait for the lists (the w8a8 wgmma and the bf16 swap-AB gate/up)."""
    AUTO = "auto"  # where the experts nobody chose would copy at most the tuning table's bytes for nothing
    ON = "on"  # wherever the lists allow it (one list builder, every slot a block row)
    OFF = "off"


class LoraSwapab(str, enum.Enum):
    """Whether the decode's LoRA gate/up shrinks run as blocks of the swap-AB gate/up (forward_plan.lora_swapab)."""
    AUTO = "auto"  # where the per-pair shrinks would read the adapters' A rows twice over (heuristics.lora_swapab_rows)
    ON = "on"  # wherever the swap-AB gate/up runs and the rank has the form
    OFF = "off"


class DecodeRouter(str, enum.Enum):
    AUTO = "auto"  # tensor cores from measured multiply-adds (the split form from its own, where topk_route routes)
    MMA = "mma"  # tensor cores, K over a cluster (router_logits_mma) at every N
    SPLIT = "split"  # tensor cores, K over the grid into logits copies top-k sums where topk_route routes, else mma
    CORES = "cores"


def _on_off(name: str, v: str) -> bool:
    if v not in ("0", "1"):
        raise OptionError(f"{name}={v!r}: must be '0' or '1'")
    return v == "1"


def _digits(v: str) -> bool:
    """ASCII digits, at most 9 of them (str.isdigit takes superscripts, int() a 5000-digit string)."""
    return 0 < len(v) <= 9 and all("0" <= c <= "9" for c in v)


def _rows(name: str, v: str) -> int:
    if not _digits(v):
        raise OptionError(f"{name}={v!r}: must be a non-negative integer")
    return int(v)


def _count(name: str, v: str) -> int:
    if not _digits(v) or int(v) < 1:
        raise OptionError(f"{name}={v!r}: must be a positive integer")
    return int(v)


RANK_ROW_LANES = (1, 2, 4, 8, 16)  # a LoRA shrink's lanes a rank row: they share one 32-bit shuffle mask


def _lanes(name: str, v: str) -> tuple[int, int]:
    t, _, vpt = v.partition("x")
    if not (_digits(t) and _digits(vpt) and int(t) in RANK_ROW_LANES and int(vpt) >= 1):
        raise OptionError(f"{name}={v!r}: must be TxV, T a power of two up to 16, V >= 1")
    return int(t), int(vpt)


def _rank_row_lanes(name: str, v: str) -> int:
    if not (_digits(v) and int(v) in RANK_ROW_LANES):
        raise OptionError(f"{name}={v!r}: must be a power of two up to 16")
    return int(v)


def _choice(enum_type):
    def parse(name: str, v: str):
        try:
            return enum_type(v)
        except ValueError:
            raise OptionError(f"{name}={v!r}: must be one of {[e.value for e in enum_type]}") from None
    return parse


def _variant(name: str, v: str) -> str:
    from .tuning import TUNING

    if v != "auto" and v not in TUNING.sm90_variants:
        raise OptionError(f"{name}={v!r}: must be 'auto' or one of {sorted(TUNING.sm90_variants)}")
    return v


def _sort_pairs(name: str, v: str) -> int:
    from .catalog import DECODE_SORT_PAIRS

    if not _digits(v) or not 1 <= int(v) <= DECODE_SORT_PAIRS:
        raise OptionError(f"{name}={v!r}: must be an integer from 1 to {DECODE_SORT_PAIRS} (the one-block sort's most)")
    return int(v)


def _lora_parts(name: str, v: str) -> int:
    if v not in ("0", "1", "2"):
        raise OptionError(f"{name}={v!r}: must be '0', '1' or '2'")
    return int(v)


def _text(name: str, v: str) -> Optional[str]:
    return v or None  # set but empty: as unset (an empty CUPYMOE_DUMP_DIR would dump into the current folder)


# field name -> (environment variable, what it does, parser, default when unset)
TABLE: dict[str, tuple[str, str, Callable[[str, str], object], object]] = {
    # service
    "cache_dir": ("CUPYMOE_CACHE_DIR", "where compiled kernels are cached (default ~/.cache/cupymoe)", _text, None),
    "build_jobs": ("CUPYMOE_BUILD_JOBS", "threads compiling kernel modules at once (default: the CPUs)", _count,
                   None),
    "profile": ("CUPYMOE_PROFILE", "1: synchronise around each stage and log its microseconds (never under "
                "capture)", _on_off, False),
    "dump_dir": ("CUPYMOE_DUMP_DIR", "write the debug dumps of each forward here as .npy (never under capture)",
                 _text, None),
    "graph_launch": ("CUPYMOE_GRAPH_LAUNCH", "0: an eager forward launches step by step, not as one captured graph",
                     _on_off, True),
    "quiet": ("CUPYMOE_QUIET", "1: no console line when the kernels are compiled on first use", _on_off, False),
    "guard": ("CUPYMOE_GUARD", "1: red zones between the workspace's buffers, filled before each forward and "
              "checked by MoeLayer.check_guard() (tests; off: no cost)", _on_off, False),
    # measurement: force one choice of the dispatch
    "fp4_decode": ("CUPYMOE_FP4_DECODE", "fp4 decode kernels: auto | mma | wgmma | cores", _choice(Fp4Decode),
                   Fp4Decode.AUTO),
    "fp8_decode": ("CUPYMOE_FP8_DECODE", "w8a16 fp8 decode: mma (tensor cores) | cores", _choice(Fp8Decode),
                   Fp8Decode.MMA),
    "w8a8_decode": ("CUPYMOE_W8A8_DECODE", "w8a8 decode kernels: auto | mma | wgmma", _choice(W8a8Decode),
                    W8a8Decode.AUTO),
    "decode_kernel": ("CUPYMOE_DECODE_KERNEL", "bf16 and w8a8 fp8 decode kernels: auto | register (bf16: "
                      "decode.cu; fp8: CUPYMOE_W8A8_DECODE's) | swapab (sm_90a wgmma, weights as M by TMA; auto "
                      "then takes the decode path up to 256 rows)", _choice(Bf16Decode),
                      Bf16Decode.AUTO),
    "gate_up_ahead": ("CUPYMOE_GATE_UP_AHEAD", "decode gate/up blocks by table slot, weights copied before the "
                      "lists land (w8a8 wgmma, bf16 swap-AB): auto (where few bytes go for nothing) | on | off",
                      _choice(GateUpAhead), GateUpAhead.AUTO),
    "decode_router": ("CUPYMOE_DECODE_ROUTER", "decode router: auto | mma (tensor cores, sm_90a, K over a cluster) | split (tensor cores, K over the "
                      "grid into copies top-k sums where topk_route routes, else mma) | cores",
                      _choice(DecodeRouter), DecodeRouter.AUTO),
    "pdl": ("CUPYMOE_PDL", "0: launch the decode chain without programmatic dependent launch", _on_off, True),
    "topk_lists": ("CUPYMOE_TOPK_LISTS", "0: top-k and the expert lists as two launches past 8 decode rows",
                   _on_off, True),
    "decode_sort_pairs": ("CUPYMOE_DECODE_SORT_PAIRS", "pairs up to which the decode and atomic paths build "
                          "their expert lists in one block (decode_build_lists; past them the three-pass sort); "
                          "default and most catalog.DECODE_SORT_PAIRS", _sort_pairs, None),
    "mma_down_pairs": ("CUPYMOE_MMA_DECODE_DOWN_PAIRS", "0: the tensor-core decode's down at one fragment a warp",
                       _on_off, True),
    "mma_blocks_per_sm": ("CUPYMOE_MMA_DECODE_BLOCKS_PER_SM", "blocks an SM the tensor-core decode's K split aims "
                          "for", _count, 1),
    "fp4_down_tiles": ("CUPYMOE_FP4_DOWN_TILES", "128-row tiles a block of the wgmma fp4 down takes (default: the "
                       "measured rule)", _count, None),
    "a8_down_tiles": ("CUPYMOE_A8_DOWN_TILES", "128-row tiles a block of the w8a8 wgmma decode's down takes "
                      "(default: the measured rule; one where it does not divide H / 128)", _count, None),
    "device_rows": ("CUPYMOE_DEVICE_ROWS", "0: the tuning table's own per-shape rows only, not those timed on this "
                    "GPU model (its by_device section)", _on_off, True),
    "sm90_variant": ("CUPYMOE_SM90_VARIANT", "the Hopper grouped GEMM variant of gate/up and down (auto or a name "
                     "of the tuning table)", _variant, "auto"),
    "sm90_down_variant": ("CUPYMOE_SM90_DOWN_VARIANT", "the Hopper grouped GEMM variant of down alone", _variant,
                          "auto"),
    "sm90_fp8_variant": ("CUPYMOE_SM90_FP8_VARIANT", "the w8a8 grouped GEMM (prefill, sm_90a): auto | cp_async | "
                         "tma (128 x 256 tiles by TMA and a producer warpgroup) | tma64 (64 x 256 tiles, two blocks an SM)", _choice(Sm90Fp8), Sm90Fp8.AUTO),
    "weight_l2_promotion": ("CUPYMOE_WEIGHT_L2_PROMOTION", "L2 promotion of the expert weights' TMA maps "
                            "(swap-AB decodes, TMA grouped GEMMs): none | 64 | 128 | 256 bytes (DECISIONS: "
                            "\"The weight maps' L2 promotion\")", _choice(L2Promotion), L2Promotion.B128),
    "lora_in_gemm": ("CUPYMOE_LORA_IN_GEMM", "LoRA experts' deltas as extra K of the TMA grouped GEMMs (prefill; "
                     "cupymoe/lora_stack.py): 0 off | 1 (s t as one bf16; default) | 2 (as two bf16 parts); only "
                     "where it can run (forward_plan.lora_stack_parts: rank <= 32, KS <= 128), else the "
                     "grouped deltas; read when a layer is built", _lora_parts, 1),
    "lora_stack_shrink": ("CUPYMOE_LORA_STACK_SHRINK", "how the stacked form's shrinks make T: auto (segments from "
                          "heuristics.LORA_SEGMENTS_FROM_ROWS rows; below them experts where the shrink's K is at "
                          "most heuristics.LORA_EXPERTS_MAX_K, else chunks) | chunks (a tile's rows bucketed "
                          "by adapter, a chunk at a time) | segments (a block a tile's rows of one adapter, on a "
                          "cp.async ring) | experts (the same a block an expert's rows of one adapter); read when "
                          "a layer is built", _choice(LoraShrink), LoraShrink.AUTO),
    "lora_fold": ("CUPYMOE_LORA_FOLD", "1: at the decode chain's fewest rows (heuristics.LORA_FOLD_ROWS) the "
                  "LoRA router delta runs as more blocks of the router's launch and is added inside the routing "
                  "launch; 0: lora_router_delta, a launch of its own; read when a layer is built", _on_off, True),
    "lora_overlap": ("CUPYMOE_LORA_OVERLAP", "1: on the prefill path (sm_90, PDL on, no stage events) the LoRA "
                     "router delta follows the router by PDL and shrinks beside it, and each stacked GEMM follows "
                     "its shrink by PDL and runs its K beside it, waiting only before its extra K; 0: both "
                     "launched plainly; read when a layer is built", _on_off, True),
    "lora_shrink_runs": ("CUPYMOE_LORA_SHRINK_RUNS", "1: the stacked form's gate/up shrink by chunks takes a "
                         "run's tiles LORA_SUB rows a block (lora_stack_t_gate_up_runs: an expert's adapters' A "
                         "read once a LORA_SUB rows, not once a tile); 0: a tile a block; read when a layer is "
                         "built", _on_off, True),
    "lora_swapab": ("CUPYMOE_LORA_SWAPAB", "where the decode's gate/up is the bf16 swap-AB kernel, its LoRA "
                    "gate/up shrinks as more of its blocks (the adapters' A rows through its TMA ring: "
                    "decode_swapab_gate_up_lora; lora_gate_up_expand_act adds the expands) instead of "
                    "lora_gate_up_act's per-pair shrinks: auto (from heuristics.LORA_SWAPAB_PAIRS_A_SLOT routed "
                    "pairs an (expert, adapter slot)) | on | off; read when a layer is built",
                    _choice(LoraSwapab), LoraSwapab.AUTO),
    "lora_down_split": ("CUPYMOE_LORA_DOWN_SPLIT", "what lora_down_delta's blocks of one pair split: cols (its "
                        "expand's output columns, each block the whole shrink) | shrink (the shrink's input "
                        "columns, the slices meeting at a ticket); read when a layer is built",
                        _choice(LoraDownSplit), LoraDownSplit.COLS),
    "lora_down_lanes": ("CUPYMOE_LORA_DOWN_LANES", "lora_down_delta's shrink: lanes a rank row x vectors a lane "
                        "in flight, as TxV (compile time; default 16x8 on sm_90, 16x4 elsewhere)", _lanes, None),
    "lora_router_t_rows": ("CUPYMOE_LORA_ROUTER_T_ROWS", "prefill rows up to which the router's LoRA shrink "
                           "runs as more column tiles of the router GEMM and its expand inside top-k "
                           "(grouped_gemm_lora<2, ...>, topk_route_lora); 0: lora_grouped_router_delta, a "
                           "launch of its own (default: heuristics.LORA_ROUTER_T_ROWS); read when a layer is "
                           "built", _rows, None),
    "lora_router_tpr": ("CUPYMOE_LORA_ROUTER_TPR", "lora_router_delta's shrink: lanes a rank row, a power of "
                        "two up to 16 (compile time; default 16)", _rank_row_lanes, None),
    "math_rows": ("CUPYMOE_MATH_ROWS", "rows per expert from which the grouped GEMMs take 128-row tiles "
                  "(default: tuning.json's math_rows_per_expert, 96 mma / 40 wgmma)", _count, None),
    "gemm_band_cols": ("CUPYMOE_GEMM_BAND_COLS", "column tiles a band of the grouped GEMMs' tile order (compile "
                       "time; default 16)", _count, None),
}

# Knobs of tools, not of the package: documented here so the list is whole.
TOOL_KNOBS = {
    "CUPYMOE_TEST_SEED": "the GPU tests' random seed (replays a failing module's draws)",
    "CUPYMOE_BASELINES": "a folder of peer baselines for python -m cupymoe bench",
    "CUPYMOE_COMMIT": "the commit python -m cupymoe bench and tune record (else git rev-parse of the tree)",
    "CUPYMOE_PROPERTY_SCALE": "the property tests' example counts, multiplied (tests/test_properties.py)",
}


@dataclass(frozen=True)
class Knobs:
    cache_dir: Optional[str] = None
    build_jobs: Optional[int] = None
    profile: bool = False
    dump_dir: Optional[str] = None
    graph_launch: bool = True
    quiet: bool = False
    guard: bool = False
    fp4_decode: Fp4Decode = Fp4Decode.AUTO
    fp8_decode: Fp8Decode = Fp8Decode.MMA
    w8a8_decode: W8a8Decode = W8a8Decode.AUTO
    decode_kernel: Bf16Decode = Bf16Decode.AUTO
    gate_up_ahead: GateUpAhead = GateUpAhead.AUTO
    decode_router: DecodeRouter = DecodeRouter.AUTO
    pdl: bool = True
    topk_lists: bool = True
    decode_sort_pairs: Optional[int] = None
    mma_down_pairs: bool = True
    mma_blocks_per_sm: int = 1
    fp4_down_tiles: Optional[int] = None
    a8_down_tiles: Optional[int] = None
    device_rows: bool = True
    sm90_variant: str = "auto"
    sm90_down_variant: str = "auto"
    sm90_fp8_variant: Sm90Fp8 = Sm90Fp8.AUTO
    weight_l2_promotion: L2Promotion = L2Promotion.B128
    lora_in_gemm: int = 1
    lora_stack_shrink: LoraShrink = LoraShrink.AUTO
    lora_fold: bool = True
    lora_overlap: bool = True
    lora_shrink_runs: bool = True
    lora_swapab: LoraSwapab = LoraSwapab.AUTO
    lora_down_split: LoraDownSplit = LoraDownSplit.COLS
    lora_down_lanes: Optional[tuple[int, int]] = None
    lora_router_t_rows: Optional[int] = None
    lora_router_tpr: Optional[int] = None
    math_rows: Optional[int] = None
    gemm_band_cols: Optional[int] = None

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Knobs":
        """The knobs as `env` (default os.environ) sets them; a bad value is an OptionError naming it."""
        env = os.environ if env is None else env
        known = {t[0] for t in TABLE.values()} | set(TOOL_KNOBS)
        unknown = sorted(k for k in env if k.startswith("CUPYMOE_") and k not in known)
        if unknown:  # a misspelt knob would otherwise leave its default in place, unnoticed
            raise OptionError(f"unknown environment variable(s) {', '.join(unknown)}: `python -m cupymoe knobs` "
                              "lists the known ones")
        values = {}
        for f in fields(cls):
            name, _, parse, default = TABLE[f.name]
            raw = env.get(name)
            values[f.name] = default if raw is None else parse(name, raw)
        return cls(**values)


def chosen(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The dispatch and build knobs `env` (default os.environ) sets, as set: what a result was measured
    under. Folder knobs are left out (a result names no machine's paths)."""
    env = os.environ if env is None else env
    return {name: env[name] for name, _, parse, _ in TABLE.values() if name in env and parse is not _text}


def describe() -> str:
    """The knob table as text (python -m cupymoe knobs)."""
    lines = [f"{name:<34} {doc}" + ("" if default is None else f" (default {default!r})") for name, doc, _, default in
             ((t[0], t[1], t[2], getattr(t[3], "value", t[3])) for t in TABLE.values())]
    lines += [f"{name:<34} {doc}" for name, doc in TOOL_KNOBS.items()]
    return "\n".join(lines)


def current() -> Knobs:
    """Knobs.from_env() of this moment (layers call it once, when built)."""
    return Knobs.from_env()
