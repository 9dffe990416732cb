"""Test helpers for LoRA: random adapters as LoraWeights, and PEFT directories written from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import ml_dtypes
import numpy as np

from cupymoe import lora
from cupymoe.config import MoeConfig
from cupymoe.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoraKey, LoraTarget, LoraWeights,
                          module_names)

ALL_TARGETS = tuple(LoraTarget)


def keys_for(cfg: MoeConfig, layer_idx: int, targets: Iterable[LoraTarget] = ALL_TARGETS,
             experts: Optional[Iterable[int]] = None) -> dict[str, LoraKey]:
    """The hub module names of `targets` (routed ones for `experts`, default all) this layer has."""
    want = set(LoraTarget(t) for t in targets)
    chosen = None if experts is None else set(experts)
    return {name: k for name, k in module_names(cfg, layer_idx).items()
            if k.target in want and (k.expert is None or chosen is None or k.expert in chosen)}


def random_lora(cfg: MoeConfig, rng: np.random.Generator, rank: int = 4, *, layer_idx: int = 0,
                targets: Iterable[LoraTarget] = ALL_TARGETS, experts: Optional[Iterable[int]] = None,
                alpha: float = 8.0, size: float = 1.0, zero_b: bool = False) -> LoraWeights:
    """cupymoe.lora.random_lora (the bench draws its adapters with it too)."""
    return lora.random_lora(cfg, rng, rank, layer_idx=layer_idx, targets=targets, experts=experts, alpha=alpha,
                            size=size, zero_b=zero_b)


def merged(cfg: MoeConfig, hw, lw: LoraWeights):
    """The base weights with each module's delta merged in: W + s B A, in float64."""
    from dataclasses import replace

    from cupymoe import formats

    changes = {}
    for key, m in lw.modules.items():
        name = key.target.value
        w = changes.get(name)
        if w is None:
            w = changes[name] = formats.dequantize(getattr(hw, name), np.float64)
        d = m.scale * (m.b.astype(np.float64) @ m.a.astype(np.float64))
        if key.expert is None:
            w += d
        else:
            w[key.expert] += d
    return replace(hw, **changes)


def _in_out(cfg: MoeConfig, t: LoraTarget) -> tuple[int, int]:
    from cupymoe.lora import _in_out as shapes

    return shapes(cfg)[t]


def _bf16_exact(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def write_peft(path: Path, lw: LoraWeights, config: Optional[dict] = None, *, extra: Optional[dict] = None,
               dtype=ml_dtypes.bfloat16) -> Path:
    """A PEFT adapter directory holding `lw`'s modules (rank r, lora_alpha from `config`)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for m in lw.modules.values():
        tensors[f"{PEFT_PREFIX}{m.name}.lora_A.weight"] = m.a.astype(dtype)
        tensors[f"{PEFT_PREFIX}{m.name}.lora_B.weight"] = m.b.astype(dtype)
    tensors.update(extra or {})
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(config or {"peft_type": "LORA", "r": lw.max_rank, "lora_alpha": 8}))
    return path
