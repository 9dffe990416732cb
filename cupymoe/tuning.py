"""The layer's measured dispatch choices, loaded from cupymoe/data/tuning.json.

Each entry of that file holds a value, what it decides, the result files that chose it and
the command that measured them (benchmarks/DECISIONS.md has the figures). The plan builder
(cupymoe/plan.py) reads TUNING; nothing else holds a measured threshold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Mapping

from .catalog import Sm90Variant

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


@dataclass(frozen=True)
class Tuning:
    decode_max_tokens: Mapping[str, int]
    atomic_max_tokens: int
    wgmma_decode_min_waves: float
    wgmma_fp4_decode_min_waves: float
    fp4_down_tiles_max_stages: int
    wgmma_gate_up_ahead_max_waste: int
    decode_router_mma_min_macs: int
    route_lists_quant_units: int
    math_rows_per_expert: Mapping[str, int]
    router_math_min_rows: int
    grouped_configs: Mapping[str, GroupedConfig]
    quant_grouped_config: Mapping[str, str]  # bf16 configuration -> the one quantized weights take
    sm90_variants: Mapping[str, Sm90Variant]
    sm90_auto: Sm90Auto
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
            wgmma_gate_up_ahead_max_waste=int(v["wgmma_gate_up_ahead_max_waste"]),
            decode_router_mma_min_macs=int(v["decode_router_mma_min_macs"]),
            route_lists_quant_units=int(v["route_lists_quant_units"]),
            math_rows_per_expert=dict(v["math_rows_per_expert"]),
            router_math_min_rows=int(v["router_math_min_rows"]),
            grouped_configs={k: GroupedConfig(*c) for k, c in v["grouped_configs"].items()},
            quant_grouped_config=dict(v["quant_grouped_config"]),
            sm90_variants={k: Sm90Variant(**c) for k, c in v["sm90_variants"].items()},
            sm90_auto=Sm90Auto(**v["sm90_auto"]),
            sources={k: {f: e[f] for f in ("decides", "result", "command") if f in e}
                     for k, e in data.items() if isinstance(e, dict)},
        )


def load(text: str | None = None) -> Tuning:
    """The tuning table (the package's file, or `text`)."""
    if text is None:
        text = resources.files("cupymoe").joinpath("data", TUNING_FILE).read_text()
    return Tuning.from_json(json.loads(text))


TUNING = load()
