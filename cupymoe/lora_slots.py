"""A layer's adapter slots on the device: reserved once (fixed addresses), filled and emptied by
copies on a stream, so a graph captured before an adapter is loaded or replaced stays valid.

What the GPU path serves today: the router's delta (cuda/lora.cu). An adapter naming a routed
or shared expert's module is refused by name at `fill`, before anything is copied, rather
than run without that delta (docs/DESIGN.md, "LoRA", says what the expert deltas need).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .config import MoeConfig
from .errors import LoraError, OptionError
from .lora import LoraTarget, LoraWeights

GPU_TARGETS = frozenset({LoraTarget.ROUTER})  # the modules whose deltas cuda/lora.cu adds
NOT_ON_GPU = "LoRA on the GPU path is not implemented yet"


def check_options(max_loras, max_lora_rank) -> tuple[int, int]:
    """(K, R): both 0 (no LoRA) or both positive integers."""
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise OptionError(f"{name}={v!r}: must be a non-negative integer")
    if (max_loras == 0) != (max_lora_rank == 0):
        raise OptionError(f"max_loras={max_loras}, max_lora_rank={max_lora_rank}: give both (LoRA on) or neither")
    return int(max_loras), int(max_lora_rank)


class LoraSlots:
    """K slots of rank up to R: the router's A [K, R, H] and scale * B [K, Rw, R], fp32, zeros
    past each adapter's rank (an empty slot adds nothing)."""

    def __init__(self, cfg: MoeConfig, max_loras: int, max_rank: int, device_id: int):
        import cupy

        self.cfg, self.max_loras, self.max_rank, self.device_id = cfg, max_loras, max_rank, device_id
        with cupy.cuda.Device(device_id):
            self.router_a = cupy.zeros((max_loras, max_rank, cfg.hidden_size), cupy.float32)
            self.router_bs = cupy.zeros((max_loras, cfg.router_width, max_rank), cupy.float32)
        self.loaded: dict[int, LoraWeights] = {}

    @property
    def nbytes(self) -> int:
        return int(self.router_a.nbytes + self.router_bs.nbytes)

    def ptr(self, name: str) -> int:
        return int({"lora_router_a": self.router_a, "lora_router_bs": self.router_bs}[name].data.ptr)

    def _slot(self, slot) -> int:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self.max_loras:
            raise LoraError(f"slot={slot!r}: must be in 0..max_loras-1 = 0..{self.max_loras - 1}")
        return int(slot)

    def fill(self, slot, adapter: LoraWeights, stream: Optional[int]) -> None:
        """Check `adapter` whole, then copy it into `slot` on `stream` (None: synchronously)."""
        slot = self._slot(slot)
        if not isinstance(adapter, LoraWeights):
            raise LoraError(f"adapter: a cupymoe.lora.LoraWeights is required, found {type(adapter).__name__}")
        adapter.check(self.cfg, self.max_rank)
        for key, m in adapter.modules.items():
            if key.target not in GPU_TARGETS:
                raise LoraError(f"{NOT_ON_GPU} for {key.target.value} modules ({m.name}); the GPU adds the "
                                f"router's delta only (docs/DESIGN.md, LoRA)")
        a = np.zeros(self.router_a.shape[1:], np.float32)
        bs = np.zeros(self.router_bs.shape[1:], np.float32)
        m = adapter.get(LoraTarget.ROUTER)
        if m is not None:  # the scale folded into B in fp32 (one rounding; the reference keeps float64)
            a[:m.rank] = m.a
            bs[:, :m.rank] = m.b * np.float32(m.scale)
        self._copy(slot, a, bs, stream)
        self.loaded[slot] = adapter

    def clear(self, slot, stream: Optional[int]) -> None:
        """Empty `slot` (zeros: rows with its id then get the base layer's routing)."""
        slot = self._slot(slot)
        self._copy(slot, None, None, stream)
        self.loaded.pop(slot, None)

    def _copy(self, slot: int, a: Optional[np.ndarray], bs: Optional[np.ndarray], stream: Optional[int]) -> None:
        import cupy

        with cupy.cuda.Device(self.device_id):
            s = cupy.cuda.ExternalStream(stream) if stream is not None else cupy.cuda.Stream.null
            if s.is_capturing():  # a copy of host memory recorded into a graph would replay stale bytes
                raise LoraError("set_lora / clear_lora during stream capture: fill slots outside capture "
                                "(a captured graph reads the slots' fixed addresses at replay)")
            with s:
                for dst, src in ((self.router_a, a), (self.router_bs, bs)):
                    if src is None:
                        dst[slot].fill(0)
                    else:
                        dst[slot].set(src, stream=s)
            if stream is None:
                s.synchronize()
