"""HostWeights: one MoE layer's tensors on the host, in the [out, in] (nn.Linear) orientation.

The data flows one way: checkpoint -> HostWeights -> device weights -> layer. The routed
experts are stacked along a leading expert axis, and each projection is either a bf16
array (`ml_dtypes.bfloat16`; float32 is accepted and means "exact values") or one of the
quantized containers of `cupymoe.formats` (fp8-block, nvfp4, mxfp4), which keep the same
leading expert axis. Shapes, for E routed experts, router width R = E + Z, hidden H,
expert intermediate I and shared intermediate Is:

    router            [R, H]        bf16 / fp8-block / nvfp4     (logits in fp32)
    gate, up          [E, I, H]     any format
    down              [E, H, I]     any format
    router_bias       [R]  f32      (gpt-oss router.bias)
    correction_bias   [R]  f32      (e_score_correction_bias: selection only)
    gate_bias/up_bias [E, I] f32,  down_bias [E, H] f32   (gpt-oss)
    shared_gate/up    [Is, H],      shared_down [H, Is]    any format
    shared_expert_gate [H] f32      (sigmoid(x . w) scales the shared expert)
    norm_weight       [H]  f32      (pre-expert RMSNorm)
    tid2eid           [V, k] int32  (hash routing: token id -> expert ids)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np

from . import formats
from .config import MoeConfig
from .errors import WeightError


def tensor_shape(t: Any) -> tuple[int, ...]:
    """Logical shape of a plain array or a quantized container (its dequantized shape)."""
    return tuple(int(d) for d in t.shape)


# the vectors the layer uploads as float32 (weights.py _f32); every other plain array is uploaded as bf16
SERVED_AS = {name: np.dtype(np.float32) for name in ("router_bias", "correction_bias", "gate_bias", "up_bias",
                                                     "down_bias", "shared_expert_gate", "norm_weight")}


@dataclass
class HostWeights:
    router: Any
    gate: Any
    up: Any
    down: Any
    router_bias: Optional[np.ndarray] = None
    correction_bias: Optional[np.ndarray] = None
    gate_bias: Optional[np.ndarray] = None
    up_bias: Optional[np.ndarray] = None
    down_bias: Optional[np.ndarray] = None
    shared_gate: Any = None
    shared_up: Any = None
    shared_down: Any = None
    shared_expert_gate: Optional[np.ndarray] = None
    norm_weight: Optional[np.ndarray] = None
    tid2eid: Optional[np.ndarray] = None
    # the fields whose device arrays the loader allocated (stacks of per-expert CUDA tensors): the
    # layer's own memory, not the caller's (MoeLayer.memory_report)
    made_on_device: frozenset = field(default=frozenset(), metadata={"tensor": False})

    def expected_shapes(self, cfg: MoeConfig) -> dict[str, Optional[tuple[int, ...]]]:
        """Every tensor's expected logical shape under `cfg`; None = must be absent."""
        E, H, I, R = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.router_width
        Is = cfg.shared_expert_intermediate_size
        sh = cfg.has_shared_expert
        return {
            "router": (R, H),
            "gate": (E, I, H),
            "up": (E, I, H),
            "down": (E, H, I),
            "router_bias": (R,) if cfg.has_router_bias else None,
            "correction_bias": (R,) if cfg.has_correction_bias else None,
            "gate_bias": (E, I) if cfg.has_expert_bias else None,
            "up_bias": (E, I) if cfg.has_expert_bias else None,
            "down_bias": (E, H) if cfg.has_expert_bias else None,
            "shared_gate": (Is, H) if sh else None,
            "shared_up": (Is, H) if sh else None,
            "shared_down": (H, Is) if sh else None,
            "shared_expert_gate": (H,) if cfg.has_shared_expert_gate else None,
            "norm_weight": (H,) if cfg.pre_expert_norm else None,
            "tid2eid": (cfg.hash_vocab_size, cfg.num_experts_per_tok) if cfg.hash_routing else None,
        }

    def validate(self, cfg: MoeConfig, *, values: bool = True) -> "HostWeights":
        """Raise WeightError naming the tensor, the expected and the found shape; with `values`,
        also the first value no kernel can use (Inf / NaN weights, e4m3 NaN codes, scales not
        finite and > 0, e8m0 255), checked on the raw bits (formats.check_values), on the device
        for CuPy arrays."""
        for name, want in self.expected_shapes(cfg).items():
            t = getattr(self, name)
            if want is None:
                if t is not None:
                    raise WeightError(f"HostWeights.{name} is present but the config does not use it "
                                     f"(found shape {tensor_shape(t)})")
                continue
            if t is None:
                raise WeightError(f"HostWeights.{name} is missing: expected shape {want}")
            got = tensor_shape(t)
            if got != want:
                raise WeightError(f"HostWeights.{name}: expected shape {want}, found {got}")
        if self.tid2eid is not None:
            t = np.asarray(self.tid2eid)
            if not np.issubdtype(t.dtype, np.integer):
                raise WeightError(f"HostWeights.tid2eid: expected an integer table, found dtype {t.dtype}")
            if t.size and (t.min() < 0 or t.max() >= cfg.router_width):
                raise WeightError(f"HostWeights.tid2eid: ids must lie in 0..{cfg.router_width - 1}, "
                                 f"found {int(t.min())}..{int(t.max())}")
        if values:
            for name in self.names():
                if name != "tid2eid":
                    t = getattr(self, name)
                    formats.check_values(t, f"HostWeights.{name}")
                    if formats.weight_format(t) == "bf16":  # a plain array: rounded where it is uploaded
                        formats.check_servable(t, f"HostWeights.{name}", SERVED_AS.get(name, formats.BF16))
        return self

    def names(self) -> list[str]:
        return [f.name for f in fields(self) if f.metadata.get("tensor", True) and getattr(self, f.name) is not None]
