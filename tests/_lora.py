"""Test helpers for LoRA: random adapters as LoraWeights, and PEFT directories written from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

import ml_dtypes
import numpy as np

from cupymoe import lora
from cupymoe.config import MoeConfig
from cupymoe.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoraKey, LoraTarget, LoraWeights,
                          module_names)
from cupymoe.lora_fused import peft_version, stacked_params

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


# ----------------------------------------------------------------------------------
# PEFT target_parameters adapters on stacked experts (cupymoe/lora_fused.py), as PEFT saves them
# ----------------------------------------------------------------------------------

STACKED_LAYER = 2


def peft_release(v: str) -> tuple[int, int, int]:
    return peft_version(v)[:3]


def peft_in_axis(transposed: bool, version: str) -> int:
    """The axis of P [E, d1, d2] PEFT takes as `in_features` (ParamWrapper.update_layer, by version)."""
    v = peft_release(version)
    if v < (0, 19, 0):
        return 1  # (num_experts, in, out) = shape, never swapped
    if v == (0, 19, 0):
        return 2 if transposed else 1  # swapped when is_transposed (the inverted rule)
    return 1 if transposed else 2  # swapped unless is_transposed (huggingface/peft#3165)


def peft_delta(a: np.ndarray, b: np.ndarray, experts: int, in_axis: int, scale: float) -> np.ndarray:
    """PEFT's get_delta_weight for a 3-D parameter, in float64: [E, d1, d2]."""
    A = a.astype(np.float64).reshape(experts, -1, a.shape[-1])  # experts x rank x in
    B = b.astype(np.float64).reshape(b.shape[0], -1, experts)  # out x rank x experts
    return np.einsum("ore,eri->eio" if in_axis == 1 else "ore,eri->eoi", B, A) * scale


def _param_shape(p) -> tuple[int, int, int]:
    return (p.experts, p.input, p.output) if p.transposed else (p.experts, p.output, p.input)


def stacked_adapter(cfg, rng, version, *, rank=3, size=0.3, params=("gate_up_proj", "down_proj"), in_axis=None,
                    layer_idx=STACKED_LAYER, counts=None):
    """{tensor name: factor} as PEFT saves target_parameters on the experts module (the first wrapped
    parameter, gate_up_proj, innermost under base_layer), and {param: dP} by PEFT's rule (scale 2);
    `in_axis` forces PEFT's `in` axis (transformers 5's patch of older PEFT for its converted families);
    `counts` {param: E_p} a parameter's leading axis where the transformers version sizes it otherwise."""
    specs = stacked_params(cfg)
    base = f"{PEFT_PREFIX}model.layers.{layer_idx}.mlp.experts"
    tensors, deltas = {}, {}
    wrapped = [p for p in ("gate_up_proj", "down_proj") if p in params]
    for depth, name in enumerate(wrapped):
        p = specs[name]
        if counts and name in counts:
            p = replace(p, experts=counts[name])
        shape = _param_shape(p)
        axis = in_axis or peft_in_axis(p.transposed, version)
        fin, fout = shape[axis], shape[3 - axis]
        a = _bf16_exact(rng.standard_normal((rank * p.experts, fin)) / np.sqrt(fin))
        b = _bf16_exact(rng.standard_normal((fout, rank * p.experts)) * size)
        prefix = base + ".base_layer" * (len(wrapped) - 1 - depth)  # the first wrapped is innermost
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
        deltas[name] = peft_delta(a, b, p.experts, axis, 2.0)
    return tensors, deltas


def write_stacked_peft(path, tensors, version, rank=3, **config):
    """A PEFT adapter directory of `tensors` (stacked_adapter's), lora_alpha 2 r, target_parameters."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
           "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], **config}
    if version is not None:
        cfg["peft_version"] = version
    (path / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    return path
