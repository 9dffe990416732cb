"""The layer's measured dispatch choices, loaded from cupymoe/data/tuning.json.

Each entry of that file holds a value, what it decides, the result files that chose it and
the command that measured them (benchmarks/DECISIONS.md has the figures). The plan builder
(cupymoe/plan.py) reads TUNING; nothing else holds a measured threshold.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from importlib import resources
from typing import Mapping, Optional

from .catalog import SWAPAB_TOKEN_TILES, WGMMA_DECODE_TOKEN_TILES, Sm90Variant
from .errors import ConfigError

TUNING_FILE = "tuning.json"


@dataclass(frozen=True)
class GroupedConfig:
    """(BM, BK, STAGES) of the mma.sync grouped GEMM."""

    bm: int
    bk: int
    stages: int


@dataclass(frozen=True)
class Sm90Auto:
    gate_up_gather: str
    gate_up: str
    gather_max_intermediate: int
    down: str
    down_long_k: str
    down_192_max_intermediate: int


# what a per-shape entry may choose (None: the global rule decides)
TUNED_PATHS = ("decode", "atomic", "prefill")
TUNED_GROUPED = ("math", "stream")
TUNED_W8A8_DECODE = ("mma", "wgmma")
TUNED_DECODE_KERNEL = ("register", "swapab")
TUNED_SM90_FP8 = ("cp_async", "tma", "tma64")
TUNED_TOKEN_TILES = SWAPAB_TOKEN_TILES  # the swap-AB decodes' token tiles
# the bf16 TMA GEMM's variants a bucket may name for gate/up or down: the 256-row-wide ones, whose
# weight maps' boxes agree (heuristics.sm90_variant_fits says which serve a layer)
TUNED_SM90 = ("tma_wide", "gather_wide", "tma_192")


@dataclass(frozen=True)
class Choice:
    """The measured-fastest choice of one (shape, format, N bucket); None leaves it to the global rule."""

    path: Optional[str] = None
    grouped: Optional[str] = None  # the grouped GEMMs' configuration (prefill, not w8a8)
    w8a8_decode: Optional[str] = None  # the w8a8 decode kernels (decode and atomic)
    decode_kernel: Optional[str] = None  # the bf16 and w8a8 decode kernels (decode and atomic)
    sm90_fp8: Optional[str] = None  # the w8a8 grouped GEMM (prefill)
    # the token tile (rows a pass) of the swap-AB decodes (None: heuristics.swapab_busy_rows' rule) or of the
    # w8a8 wgmma decode (None: heuristics.w8a8_decode_kernel's rule)
    token_tile: Optional[int] = None
    sm90_gate_up: Optional[str] = None  # the bf16 TMA GEMM variant of gate/up (prefill math; None: the layer's)
    sm90_down: Optional[str] = None  # ... of down

    def __post_init__(self):
        for name, allowed in (("path", TUNED_PATHS), ("grouped", TUNED_GROUPED), ("w8a8_decode", TUNED_W8A8_DECODE),
                              ("decode_kernel", TUNED_DECODE_KERNEL), ("sm90_fp8", TUNED_SM90_FP8),
                              ("token_tile", TUNED_TOKEN_TILES), ("sm90_gate_up", TUNED_SM90),
                              ("sm90_down", TUNED_SM90)):
            v = getattr(self, name)
            if v is not None and (v not in allowed or type(v) is not type(allowed[0])):
                raise ValueError(f"tuning table: {name}={v!r} must be one of {allowed}")
        if self.token_tile is not None and self.decode_kernel != "swapab":
            if self.w8a8_decode != "wgmma" or self.decode_kernel is not None:
                raise ValueError(f"tuning table: token_tile={self.token_tile} needs decode_kernel='swapab' or "
                                 f"w8a8_decode='wgmma', found decode_kernel={self.decode_kernel!r}, "
                                 f"w8a8_decode={self.w8a8_decode!r}")
            if self.token_tile not in WGMMA_DECODE_TOKEN_TILES:
                raise ValueError(f"tuning table: token_tile={self.token_tile} with w8a8_decode='wgmma' must be one "
                                 f"of {WGMMA_DECODE_TOKEN_TILES}")
        if (self.sm90_gate_up or self.sm90_down) and (self.path != "prefill" or self.grouped not in (None, "math")):
            raise ValueError(f"tuning table: sm90_gate_up={self.sm90_gate_up!r} / sm90_down={self.sm90_down!r} need "
                             f"path='prefill' on the math tiles, found path={self.path!r}, grouped={self.grouped!r}")

    def label(self) -> str:
        tile = f"nt{self.token_tile}" if self.token_tile else None
        gu = f"gate_up={self.sm90_gate_up}" if self.sm90_gate_up else None
        dn = f"down={self.sm90_down}" if self.sm90_down else None
        return "/".join(v for v in (self.path, self.grouped, self.w8a8_decode, self.decode_kernel, tile,
                                    self.sm90_fp8, gu, dn) if v) or "default"


# a layer's entries: (bucket, choice) by rising bucket. Bucket b, a power of two, serves b/2 < N <= b; a
# three-quarter bucket m = 3b/4 (b >= 4), where a row has it, takes b/2 < N <= m from it (crossovers
# fall between the powers of two; bucket_lookup)
TunedBuckets = tuple[tuple[int, Choice], ...]


def n_bucket(n: int) -> int:
    """The power of two a row count's entry is filed under: b/2 < n <= b."""
    return 1 << max(0, int(n) - 1).bit_length()


def fine_bucket(n: int) -> int:
    """The finest bucket holding n: its three-quarter bucket 3b/4 where n <= 3b/4, else n_bucket's b."""
    b = n_bucket(n)
    return 3 * b // 4 if b >= 4 and n <= 3 * b // 4 else b


def is_bucket(b: int) -> bool:
    """Whether b is a bucket a row may be filed under: a power of two or three quarters of one (3, 6, 12, ...)."""
    return b >= 1 and (b == n_bucket(b) or (b % 3 == 0 and b // 3 == n_bucket(b // 3)))


def bucket_start(b: int) -> int:
    """The largest row count below what bucket b serves (b/2 for a power of two, 2b/3 for a three-quarter one)."""
    return b // 2 if b == n_bucket(b) else 2 * b // 3


def bucket_lookup(buckets: TunedBuckets, n: int) -> Optional[Choice]:
    """The row that serves n: its three-quarter bucket's where it has one, else its power of two's; None."""
    found = dict(buckets)
    return found.get(fine_bucket(n), found.get(n_bucket(n)))


def merged_buckets(base: TunedBuckets, over: TunedBuckets) -> TunedBuckets:
    """`base` with each bucket `over` has replaced by its row (a GPU's own rows over the table's)."""
    return tuple(sorted({**dict(base), **dict(over)}.items()))


def shape_key(hidden: int, intermediate: int, n_local: int, num_experts: int, top_k: int,
              shared_intermediate: int = 0) -> str:
    """The shape class an entry is measured on (routed experts on this GPU of all, shared expert's I)."""
    return (f"H{hidden} I{intermediate} E{n_local}/{num_experts} k{top_k}"
            + (f" S{shared_intermediate}" if shared_intermediate else ""))


def format_key(label: str, w8a8: bool) -> str:
    """fp8 is two families of kernels: w8a8 and w8a16 are tuned apart."""
    return f"{label}:{'w8a8' if w8a8 else 'w8a16'}" if label == "fp8_block" else label


# what a by_shape row may hold besides its Choice's fields: its key and its record of the measurement
# timed_on: the GPU a row was timed on where it is not the table's `device` (tune --apply --other-gpu)
ROW_KEYS = ("shape", "format", "n", "us", "default", "default_us", "preset", "measured_at", "result", "command",
            "timed_on")
ROW_FORMATS = ("bf16", "fp8_block:w8a8", "fp8_block:w8a16", "nvfp4", "mxfp4")
SHAPE_KEY = re.compile(r"H\d+ I\d+ E\d+/\d+ k\d+( S\d+)?")


def parse_by_shape(rows) -> Mapping[tuple[str, str], TunedBuckets]:
    """The by_shape entry's rows -> {(shape key, format key): buckets by rising N}; a row with an unknown
    field, a key no layer has, or a second row for its (shape, format, N bucket) is a ConfigError naming it."""
    out: dict[tuple[str, str], dict[int, Choice]] = {}
    allowed = set(ROW_KEYS) | {f.name for f in fields(Choice)}
    for r in rows:
        shape, fmt, b = r.get("shape"), r.get("format"), r.get("n")
        where = f"tuning table: by_shape row shape={shape!r} format={fmt!r} n={b!r}"
        if unknown := sorted(set(r) - allowed):
            raise ConfigError(f"{where}: unknown field(s) {unknown} (a row holds {sorted(allowed)})")
        if not isinstance(shape, str) or not SHAPE_KEY.fullmatch(shape):
            raise ConfigError(f"{where}: shape must read like 'H2048 I768 E128/128 k8' (tuning.shape_key)")
        if fmt not in ROW_FORMATS:
            raise ConfigError(f"{where}: format must be one of {ROW_FORMATS}")
        if isinstance(b, bool) or not isinstance(b, int) or not is_bucket(b):
            raise ConfigError(f"{where}: n={b!r} is neither a power of two nor three quarters of one")
        try:
            c = Choice(**{f.name: r.get(f.name) for f in fields(Choice)})
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if b in out.setdefault((shape, fmt), {}):
            raise ConfigError(f"{where}: a second row for this shape, format and N bucket")
        out[(shape, fmt)][b] = c
    return {k: tuple(sorted(v.items())) for k, v in out.items()}


def parse_by_device(sections) -> Mapping[str, Mapping[tuple[str, str], TunedBuckets]]:
    """The by_device entry: {GPU name as the driver reports it: by_shape rows timed on that GPU}."""
    if not isinstance(sections, Mapping):
        raise ConfigError(f"tuning table: by_device must map a GPU's name to its rows, found {type(sections).__name__}")
    out = {}
    for gpu, rows in sections.items():
        if not isinstance(gpu, str) or not gpu or not isinstance(rows, list):
            raise ConfigError(f"tuning table: by_device[{gpu!r}] must be a GPU's name with a list of by_shape rows")
        try:
            out[gpu] = parse_by_shape(rows)
        except ConfigError as e:
            raise ConfigError(f"{e} (by_device[{gpu!r}])") from None
    return out


@dataclass(frozen=True)
class Tuning:
    decode_max_tokens: Mapping[str, int]
    atomic_max_tokens: int
    wgmma_decode_min_waves: float
    wgmma_fp4_decode_min_waves: float
    fp4_down_tiles_max_stages: int
    a8_down_tiles_max_k_steps: int
    a8_down_tiles_min_waves: float
    gate_up_ahead_max_waste: int
    decode_router_mma_min_macs: int
    decode_router_split_min_macs: int
    route_lists_quant_units: int
    math_rows_per_expert: Mapping[str, int]
    router_math_min_rows: int
    grouped_configs: Mapping[str, GroupedConfig]
    quant_grouped_config: Mapping[str, str]  # bf16 configuration -> the one quantized weights take
    sm90_variants: Mapping[str, Sm90Variant]
    sm90_auto: Sm90Auto
    by_shape: Mapping[tuple[str, str], TunedBuckets]  # measured per (shape, format, N bucket); may be empty
    by_shape_arch: str  # the architecture by_shape was measured on (its rows name that arch's kernels)
    # rows timed on other GPUs of that arch, by the name the driver reports: each replaces the table's row
    # of its bucket on that GPU (the copy rate moves the crossovers; the arch's kernels are the same)
    by_device: Mapping[str, Mapping[tuple[str, str], TunedBuckets]]
    device: str  # the GPU by_shape was timed on (the driver's name)
    sources: Mapping[str, Mapping]  # entry -> {"decides", "result", "command"}

    @classmethod
    def from_json(cls, data: Mapping) -> "Tuning":
        v = {k: e["value"] for k, e in data.items() if isinstance(e, dict) and "value" in e}
        return cls(
            decode_max_tokens=dict(v["decode_max_tokens"]),
            atomic_max_tokens=int(v["atomic_max_tokens"]),
            wgmma_decode_min_waves=float(v["wgmma_decode_min_waves"]),
            wgmma_fp4_decode_min_waves=float(v["wgmma_fp4_decode_min_waves"]),
            fp4_down_tiles_max_stages=int(v["fp4_down_tiles_max_stages"]),
            a8_down_tiles_max_k_steps=int(v["a8_down_tiles_max_k_steps"]),
            a8_down_tiles_min_waves=float(v["a8_down_tiles_min_waves"]),
            gate_up_ahead_max_waste=int(v["gate_up_ahead_max_waste"]),
            decode_router_mma_min_macs=int(v["decode_router_mma_min_macs"]),
            decode_router_split_min_macs=int(v["decode_router_split_min_macs"]),
            route_lists_quant_units=int(v["route_lists_quant_units"]),
            math_rows_per_expert=dict(v["math_rows_per_expert"]),
            router_math_min_rows=int(v["router_math_min_rows"]),
            grouped_configs={k: GroupedConfig(*c) for k, c in v["grouped_configs"].items()},
            quant_grouped_config=dict(v["quant_grouped_config"]),
            sm90_variants={k: Sm90Variant(**c) for k, c in v["sm90_variants"].items()},
            sm90_auto=Sm90Auto(**v["sm90_auto"]),
            by_shape=parse_by_shape(v.get("by_shape", [])),
            by_shape_arch=str(data.get("arch", "sm_90a")),
            by_device=parse_by_device(v.get("by_device", {})),
            device=str(data.get("device", "")),
            sources={k: {f: e[f] for f in ("decides", "result", "command") if f in e}
                     for k, e in data.items() if isinstance(e, dict)},
        )

    def note(self, gpu: str, arch: str, device_rows: bool = True) -> str:
        """Which per-shape rows a layer on `gpu` (compiled for `arch`) takes, in a line (`python -m cupymoe info`;
        `device_rows`: CUPYMOE_DEVICE_ROWS)."""
        own = sum(len(b) for b in self.by_shape.values())
        if arch != self.by_shape_arch:
            return f"tuning table: its per-shape rows name {self.by_shape_arch}'s kernels; on {arch} the global rules decide"
        if gpu in self.by_device and not device_rows:
            return f"tuning table: the table's {own} per-shape rows (for {self.device}): CUPYMOE_DEVICE_ROWS=0 leaves this GPU's own out"
        if gpu in self.by_device:
            mine = sum(len(b) for b in self.by_device[gpu].values())
            return f"tuning table: {mine} rows timed on this GPU, the table's {own} (for {self.device}) where they lack a bucket"
        if gpu == self.device:
            return f"tuning table: its {own} per-shape rows, for this GPU"
        return (f"tuning table: the {own} per-shape rows for {self.device} (none of this GPU's own: "
                "`python -m cupymoe tune`, then `tune --apply`, adds them)")

    def rows_for(self, key: tuple[str, str], device: Optional[str] = None) -> TunedBuckets:
        """A (shape, format) key's buckets on the GPU named `device`: its own rows over the table's."""
        return merged_buckets(self.by_shape.get(key, ()), self.by_device.get(device or "", {}).get(key, ()))


def load(text: str | None = None) -> Tuning:
    """The tuning table (the package's file, or `text`)."""
    if text is None:
        text = resources.files("cupymoe").joinpath("data", TUNING_FILE).read_text()
    return Tuning.from_json(json.loads(text))


TUNING = load()
