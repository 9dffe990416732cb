"""A layer's adapter slots on the device: reserved once (fixed addresses), filled and emptied by
copies on a stream, so a graph captured before an adapter is loaded or replaced stays valid.

The router's slots are fp32 (A [K, R, H], s B [K, Rw, R]; cuda/lora.cu lora_router_delta). The
experts' slots (where the layer serves expert deltas: MoeLayer(lora_experts=...), serves_experts) are bf16, A
and B as the adapter gives them and the scale apart in fp32, one matrix a (slot, table slot,
projection), the shared expert at table slot n_local: bf16 halves memory that grows with
K (E_local + 1) R (3 H + 3 I), and PEFT adapters are trained and shipped in bf16, so their
values are kept exactly (an fp32 adapter is rounded once a value). Zeros past an adapter's
rank and for modules it does not name, so an empty slot adds nothing. A layer of router slots
alone refuses an adapter naming an expert module by name at `fill`, before anything is copied
(the default on a w8a8 layer, whose gate/up quantizes the activation in the GEMM's epilogue,
before a delta could be added: with lora_experts=True its LoRA forwards run as w8a16). Where the
layer runs the stacked form (forward_plan.lora_stack_parts), each projection's B also lies in
Bext [E_local + 1, rows, KS] (cupymoe/lora_stack.py), filled and cleared with the slot.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from . import catalog as C
from .config import MoeConfig, is_integer
from .errors import LoraError, OptionError
from .formats import BF16
from .launch import Driver
from .layer_checks import check_stream
from . import lora_stack
from .lora import LoraTarget, LoraWeights

# the experts' projections in lora_scale's order: (a routed expert's target, the shared expert's)
PROJECTIONS = ((LoraTarget.GATE, LoraTarget.SHARED_GATE), (LoraTarget.UP, LoraTarget.SHARED_UP),
               (LoraTarget.DOWN, LoraTarget.SHARED_DOWN))


def check_options(max_loras, max_lora_rank) -> tuple[int, int]:
    """(K, R): both 0 (no LoRA) or both positive integers."""
    for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not is_integer(v) or v < 0:
            raise OptionError(f"{name}={v!r}: must be a non-negative integer")
    if (max_loras == 0) != (max_lora_rank == 0):
        raise OptionError(f"max_loras={max_loras}, max_lora_rank={max_lora_rank}: give both (LoRA on) or neither")
    return int(max_loras), int(max_lora_rank)


def check_rank_fits(cfg: MoeConfig, max_rank: int, max_smem: int) -> None:
    """OptionError where a LoRA kernel's shared memory at `max_rank` would pass what the GPU opts in to
    (`max_smem` bytes a block): the per-pair kernels hold t (two projections' ranks in lora_gate_up_act),
    top-k's LoRA form each warp's t; refused at construction, not mid-forward."""
    need = max(C.lora_pair_smem_bytes(max_rank, 2), C.topk_route_lora_smem_bytes(cfg.router_width, max_rank))
    if need > max_smem:
        raise OptionError(f"max_lora_rank={max_rank}: the LoRA kernels would ask {need} bytes of shared memory a "
                          f"block, this GPU gives at most {max_smem}; reserve a smaller rank")


def bf16_parts(a: np.ndarray, parts: int) -> np.ndarray:
    """fp32 `a` as `parts` bf16 values (returned as float32) whose sum is `a`: each the bf16 nearest
    the rest so far (cuda/lora.cu lora_split3's split; three parts hold fp32's 24 bits)."""
    rest = np.asarray(a, np.float32)
    out = np.empty((parts,) + rest.shape, np.float32)
    for p in range(parts):
        out[p] = rest.astype(BF16).astype(np.float32)
        rest = rest - out[p]  # exact: out[p] is rest to 8 bits
    return out


@dataclass(frozen=True)
class ExpertSlotShape:
    """Where the experts' deltas go: the table slot of each owned expert (slot n_local: the shared
    expert) and the padded width I_max of the expert table."""

    owned: tuple[int, ...]  # global expert ids, in table-slot order
    i_max: int

    @property
    def table_slots(self) -> int:
        return len(self.owned) + 1


class LoraSlots:
    """K slots of rank up to R: the router's (fp32; with `router_parts` its A also as three bf16 parts,
    lora_router_a3) and, with `experts`, every projection's of every table slot (bf16, module
    docstring). `ptr(name)` gives the kernels' addresses by plan name."""

    def __init__(self, cfg: MoeConfig, max_loras: int, max_rank: int, device_id: int,
                 experts: Optional[ExpertSlotShape] = None, stack_parts: int = 0, router_parts: bool = False):
        import cupy

        self.cfg, self.max_loras, self.max_rank, self.device_id = cfg, max_loras, max_rank, device_id
        self.experts = experts
        # every workspace a layer reading these slots is bound to (MoeLayer.with_workspace shares them):
        # a fill or clear waits for each one's last forward (a copy and its workspace must outlive their
        # forwards anyway: the scratch they run in is the workspace's)
        self._readers: "weakref.WeakSet" = weakref.WeakSet()
        self._readers_lock = threading.Lock()  # a layer bound on one thread while another fills a slot
        # the stacked form's Bext (cupymoe/lora_stack.py), parts of s t its T keeps; 0: none
        self.stack_parts = int(stack_parts) if experts is not None else 0
        self._stacked: dict[str, object] = {}  # Bext by name: every slot's columns, no K axis
        H, K, R = cfg.hidden_size, max_loras, max_rank
        self._arrays: dict[str, object] = {}
        with cupy.cuda.Device(device_id):
            self._arrays["lora_router_a"] = cupy.zeros((K, R, H), cupy.float32)
            self._arrays["lora_router_bs"] = cupy.zeros((K, cfg.router_width, R), cupy.float32)
            if router_parts:  # A in three bf16 parts, the router GEMM's LoRA columns (forward_plan.lora_router_t)
                self._arrays["lora_router_a3"] = cupy.zeros((K, C.LORA_ROUTER_PARTS, R, H), cupy.uint16)
            if experts is not None:
                for name, shape in self._expert_shapes().items():  # bf16 as uint16 (CuPy has no bf16)
                    self._arrays[name] = cupy.zeros((K, *shape), cupy.uint16)
                self._arrays["lora_scale"] = cupy.zeros((K, experts.table_slots, 3), cupy.float32)
                for name, shape in self._stacked_shapes().items():
                    self._stacked[name] = cupy.zeros(shape, cupy.uint16)
        self.loaded: dict[int, LoraWeights] = {}

    def _expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each expert array's shape past the K axis (S table slots): A [S, R, in], B [S, out, R]."""
        H, R = self.cfg.hidden_size, self.max_rank
        S, I = self.experts.table_slots, self.experts.i_max
        return {"lora_gate_a": (S, R, H), "lora_gate_b": (S, I, R), "lora_up_a": (S, R, H), "lora_up_b": (S, I, R),
                "lora_down_a": (S, R, I), "lora_down_b": (S, H, R)}

    def _stacked_shapes(self) -> dict[str, tuple[int, int]]:
        """Bext of each projection (lora_stack.py), [S rows, KS] (gate, up: I_max rows a table slot;
        down: H), named after the B slots they stack (lora_gate_b -> lora_gate_bx)."""
        if not self.stack_parts:
            return {}
        H, S, I = self.cfg.hidden_size, self.experts.table_slots, self.experts.i_max
        ks = lora_stack.stack_width(self.max_loras, self.max_rank, self.stack_parts)
        return {"lora_gate_bx": (S * I, ks), "lora_up_bx": (S * I, ks), "lora_down_bx": (S * H, ks)}

    @property
    def stack_width(self) -> int:
        """KS of the stacked form (0: none)."""
        return lora_stack.stack_width(self.max_loras, self.max_rank, self.stack_parts) if self.stack_parts else 0

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self._arrays.values())
                   + sum(a.nbytes for a in self._stacked.values()))

    def ptr(self, name: str) -> int:
        if name in self._stacked:
            return int(self._stacked[name].data.ptr)
        return int(self._arrays[name].data.ptr)

    def _slot(self, slot) -> int:
        if not is_integer(slot) or not 0 <= slot < self.max_loras:
            raise LoraError(f"slot={slot!r}: must be in 0..max_loras-1 = 0..{self.max_loras - 1}")
        return int(slot)

    def add_reader(self, ws) -> None:
        """A workspace whose forwards read the slots from now on (MoeLayer._bind)."""
        with self._readers_lock:
            self._readers.add(ws)

    def reader_events(self) -> tuple[int, ...]:
        """The done events of the workspaces whose forwards may read the slots."""
        with self._readers_lock:
            return tuple(ws.done_event for ws in self._readers)

    def fill(self, slot, adapter: LoraWeights, stream: Optional[int], after: Sequence[int] = ()) -> None:
        """Check `adapter` whole, then copy it into `slot` on `stream` (None: synchronously), once the
        events `after` have completed."""
        slot = self.check(slot, adapter)
        self._copy(slot, self._host_slot(adapter), stream, after)
        self.loaded[slot] = adapter

    def check(self, slot, adapter: LoraWeights) -> int:
        """The slot's index if `adapter` can go into it (fill's checks, nothing copied); else LoraError."""
        slot = self._slot(slot)
        if not isinstance(adapter, LoraWeights):
            raise LoraError(f"adapter: a cupymoe.lora.LoraWeights is required, found {type(adapter).__name__}")
        adapter.check(self.cfg, self.max_rank)
        if self.experts is None:
            for key, m in adapter.modules.items():
                if key.target != LoraTarget.ROUTER:
                    raise LoraError(f"{key.target.value} modules ({m.name}): this layer's slots take the "
                                    "router's alone (lora_experts=False, the default on a w8a8 layer); build "
                                    "it with lora_experts=True (docs/DESIGN.md, LoRA)")
        return slot

    def _host_slot(self, adapter: LoraWeights) -> dict[str, np.ndarray]:
        """One slot's contents on the host, by array name."""
        host = {name: np.zeros(a.shape[1:], np.float32) for name, a in self._arrays.items()}
        m = adapter.get(LoraTarget.ROUTER)
        if m is not None:  # the scale folded into B in fp32 (one rounding; the reference keeps float64)
            host["lora_router_a"][:m.rank] = m.a
            if "lora_router_a3" in host:
                host["lora_router_a3"][:, :m.rank] = bf16_parts(m.a, C.LORA_ROUTER_PARTS)
            host["lora_router_bs"][:, :m.rank] = m.b * np.float32(m.scale)
        if self.experts is not None:
            self._host_experts(adapter, host)
        return {name: (v.astype(BF16).view(np.uint16) if self._arrays[name].dtype == np.uint16 else v)
                for name, v in host.items()}

    def _host_experts(self, adapter: LoraWeights, host: dict[str, np.ndarray]) -> None:
        table_slot = {e: i for i, e in enumerate(self.experts.owned)}
        shared = len(self.experts.owned)
        for key, m in adapter.modules.items():
            if key.target == LoraTarget.ROUTER:
                continue
            p = next(i for i, pair in enumerate(PROJECTIONS) if key.target in pair)
            ts = shared if key.expert is None else table_slot.get(key.expert)
            if ts is None:  # another rank's expert: that rank adds its delta
                continue
            name = PROJECTIONS[p][0].value
            a, b = host[f"lora_{name}_a"][ts], host[f"lora_{name}_b"][ts]
            a[:m.rank, :m.a.shape[1]] = m.a
            b[:m.b.shape[0], :m.rank] = m.b
            host["lora_scale"][ts, p] = m.scale

    def clear(self, slot, stream: Optional[int], after: Sequence[int] = ()) -> None:
        """Empty `slot` (zeros: rows with its id then get the base layer), after the events `after`."""
        slot = self._slot(slot)
        self._copy(slot, None, stream, after)
        self.loaded.pop(slot, None)

    def _copy(self, slot: int, host: Optional[dict[str, np.ndarray]], stream: Optional[int],
              after: Sequence[int] = ()) -> None:
        import cupy

        from .debug import cupy_stream

        if stream is not None:
            stream = check_stream(stream)  # a cudaStream_t as an int, before CuPy wraps it
        with cupy.cuda.Device(self.device_id):
            s = cupy_stream(stream, self.device_id) if stream is not None else cupy.cuda.Stream.null
            if s.is_capturing():  # a copy of host memory recorded into a graph would replay stale bytes
                raise LoraError("set_lora / clear_lora during stream capture: fill slots outside capture "
                                "(a captured graph reads the slots' fixed addresses at replay)")
            # forwards still reading the slot on other streams (a non-blocking one ignores the null stream)
            for event in after:
                Driver.wait(int(s.ptr), event)
            with s:
                for name, dst in self._arrays.items():
                    if host is None:
                        dst[slot].fill(0)
                    else:
                        dst[slot].set(np.ascontiguousarray(host[name]), stream=s)
                self._copy_stacked(slot)
            if stream is None:
                s.synchronize()

    def _copy_stacked(self, slot: int) -> None:
        """Slot's columns of each Bext (lora_stack.stacked_b's): its B [S, out, R] as just written
        to the slot arrays (zeros for a cleared slot), at each part's R columns; a device copy on
        the current stream, ordered after the upload."""
        R = self.max_rank
        for name, dst in self._stacked.items():
            src = self._arrays[name[:-1]][slot].reshape(-1, R)  # lora_gate_bx <- lora_gate_b
            for c in lora_stack.slot_columns(slot, self.max_loras, R, self.stack_parts):
                dst[:, c:c + R] = src


def serves_experts(lora_experts: Optional[bool], w8a8: bool) -> bool:
    """MoeLayer(lora_experts=...): whether the slots take the experts' modules; None: all but a w8a8
    layer's (which then run their LoRA forwards' experts as w8a16, plan.lora_options)."""
    if lora_experts is not None and not isinstance(lora_experts, bool):
        raise OptionError(f"lora_experts={lora_experts!r}: must be True, False or None")
    return not w8a8 if lora_experts is None else lora_experts


def expert_slot_shape(owned: Sequence[int], i_max: int, experts: bool) -> Optional[ExpertSlotShape]:
    """The experts' slots a layer reserves: none where its slots take the router's modules alone."""
    return ExpertSlotShape(tuple(int(e) for e in owned), int(i_max)) if experts else None
