"""Device weights and the per-expert pointer tables the kernels read.

Made once at load. The routed experts this rank owns are uploaded as stacked arrays
([n_local, I, H] for gate and up, [n_local, H, I] for down, bf16); the kernels reach them
through pointer tables indexed by table slot: slots 0 .. n_local-1 are the owned experts
in order, slot n_local is the shared expert (its own intermediate size, its own arrays),
so the shared expert rides through the same expert kernels as one more expert.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import formats
from .config import MoeConfig
from .host_weights import HostWeights


class UnsupportedFormatError(NotImplementedError):
    """A weight format the GPU kernels do not serve yet; names the tensor and format."""


def _bf16_bits(t: Any, name: str):
    """A bf16 (or float32, rounded) host array as contiguous uint16 bits.

    A CuPy uint16 array is taken as bf16 bits already on the device (the benchmark draws
    its large random weights there); it is copied, so the layer owns its weights.
    """
    if type(t).__module__.startswith("cupy"):
        if t.dtype != np.uint16:
            raise UnsupportedFormatError(f"{name}: a CuPy array must hold bf16 bits as uint16, found {t.dtype}")
        return t
    fmt = formats.weight_format(t)
    if fmt != "bf16":
        raise UnsupportedFormatError(
            f"{name}: {fmt} weights are not served by the GPU kernels yet (bf16 only); "
            "dequantize on the host or wait for the quantized-expert kernels"
        )
    a = np.asarray(t)
    if a.dtype != formats.BF16:
        a = a.astype(np.float32).astype(formats.BF16)
    return np.ascontiguousarray(a).view(np.uint16)


def _f32(t: Optional[np.ndarray]) -> Optional[np.ndarray]:
    return None if t is None else np.ascontiguousarray(np.asarray(t, dtype=np.float32))


class DeviceWeights:
    def __init__(self, cfg: MoeConfig, hw: HostWeights, device_id: int, owned: Optional[Sequence[int]] = None):
        """`owned`: the routed experts this rank computes (default: the config's contiguous block)."""
        import cupy

        hw.validate(cfg)
        self.cfg = cfg
        owned = list(cfg.owned_experts() if owned is None else owned)
        self.n_local = len(owned)
        # slot_of[e]: expert e's table slot here, -1 for other ranks' experts and zero experts
        slot_of = np.full(cfg.router_width, -1, np.int32)
        slot_of[owned] = np.arange(len(owned), dtype=np.int32)
        sl = _selector(owned)
        self._keep: list[Any] = []  # device arrays the pointer tables point into

        def up(a: Optional[np.ndarray]):
            if a is None:
                return None
            d = cupy.array(a, copy=True)  # the layer owns its copy, whatever the caller does
            self._keep.append(d)
            return d

        def ptr(d) -> int:
            return 0 if d is None else int(d.data.ptr)

        with cupy.cuda.Device(device_id):
            self.slot_of = up(slot_of)
            self.router = up(_bf16_bits(hw.router, "router"))
            self.router_bias = up(_f32(hw.router_bias))
            self.correction_bias = up(_f32(hw.correction_bias))
            self.norm_weight = up(_f32(hw.norm_weight))
            self.shared_expert_gate = up(_f32(hw.shared_expert_gate))
            self.tid2eid = up(None if hw.tid2eid is None else np.ascontiguousarray(hw.tid2eid, dtype=np.int32))

            gate = up(_bf16_bits(hw.gate[sl], "gate"))
            upw = up(_bf16_bits(hw.up[sl], "up"))
            down = up(_bf16_bits(hw.down[sl], "down"))
            # the stacked routed experts ([n_local, I, H], [n_local, H, I], bf16 bits), kept
            # by name for code that reads them whole (the benchmark's torch peers)
            self.experts = {"gate": gate, "up": upw, "down": down}
            gb = up(_f32(None if hw.gate_bias is None else hw.gate_bias[sl]))
            ub = up(_f32(None if hw.up_bias is None else hw.up_bias[sl]))
            db = up(_f32(None if hw.down_bias is None else hw.down_bias[sl]))

            H, I = cfg.hidden_size, cfg.moe_intermediate_size
            n = self.n_local
            slots = n + 1  # + the shared expert's slot (zeros when there is none)
            tables = {k: np.zeros(slots, np.uint64) for k in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")}
            inter = np.zeros(slots, np.int32)
            for e in range(n):
                tables["gate"][e] = ptr(gate) + e * I * H * 2
                tables["up"][e] = ptr(upw) + e * I * H * 2
                tables["down"][e] = ptr(down) + e * H * I * 2
                if gb is not None:
                    tables["gate_bias"][e] = ptr(gb) + e * I * 4
                    tables["up_bias"][e] = ptr(ub) + e * I * 4
                    tables["down_bias"][e] = ptr(db) + e * H * 4
                inter[e] = I
            if cfg.has_shared_expert:
                tables["gate"][n] = ptr(up(_bf16_bits(hw.shared_gate, "shared_gate")))
                tables["up"][n] = ptr(up(_bf16_bits(hw.shared_up, "shared_up")))
                tables["down"][n] = ptr(up(_bf16_bits(hw.shared_down, "shared_down")))
                inter[n] = cfg.shared_expert_intermediate_size
            self.tables = {k: up(v) for k, v in tables.items()}
            self.inter = up(inter)
        self.shared_slot = n
        self.i_max = int(inter.max())
        self.nbytes = sum(int(d.nbytes) for d in self._keep)

    def ptr(self, name: str) -> int:
        """Raw pointer of a named device tensor (0 when the layer has none)."""
        d = self.tables[name] if name in self.tables else getattr(self, name)
        return 0 if d is None else int(d.data.ptr)


def _selector(owned: list[int]):
    """Index of the owned experts along the stacked expert axis: a slice when contiguous
    (a view, no host copy), else an index array."""
    if owned and owned == list(range(owned[0], owned[-1] + 1)):
        return slice(owned[0], owned[-1] + 1)
    return np.asarray(owned, dtype=np.int64)
