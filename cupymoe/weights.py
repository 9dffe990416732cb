"""Device weights and the per-expert pointer tables the kernels read.

Made once at load. The routed experts this rank owns are held as stacked arrays
([n_local, I, H] for gate and up, [n_local, H, I] for down); the kernels reach them
through pointer tables indexed by table slot: slots 0 .. n_local-1 are the owned experts
in order, slot n_local is the shared expert (its own intermediate size, its own arrays),
so the shared expert rides through the same expert kernels as one more expert.

Quantized experts (fp8_block, nvfp4, mxfp4) are uploaded as the checkpoint stores them,
codes and scales, with one change: the bits inside each 32-bit word of fp4 codes are
repacked on the device (cuda/repack.cu; formats.fp4_word_bit_map is the map and why), so
the kernels place a word's 8 codes as bf16 in 8 integer operations instead of 13; sizes,
strides and scales stay the checkpoint's (cuda/quant.cuh has the layout the kernels read).
Per slot the tables hold the weight pointer, the scale pointer, the matrix's global
scale (nvfp4's scale_2; 1 otherwise) and the slot's format code. All routed experts share
one format; the shared expert may have another (a bf16 shared expert next to quantized
routed experts is the common case), and the kernels run once per format present.

Device arrays are used where they lie when they are already what the kernels read (_Store): a
CuPy array (a torch CUDA tensor comes as a DLPack view, no copy) that is C-contiguous on the
layer's device in the kernels' dtype (bf16 bits as uint16, e4m3 / e8m0 bytes as uint8, float32
scales and vectors) at a 16-byte aligned address (the kernels' vector loads and TMA) is borrowed
and kept alive; it must not change while the layer lives.
Anything else is copied, on the device for a device array (never through the host): strided
views (transformers 5's gate and up halves of `gate_up_proj`, since the TMA GEMM reads each
stack as one contiguous matrix), float32 / float16 values (rounded to bf16 there), an expert
gather for an explicit expert -> rank map, and fp4 codes always (the repack rewrites them).
`memory` says how many bytes are the layer's own, borrowed and tables.

A quantized router (fp8_block, nvfp4) is dequantized once here to bf16, rounding each
weight once (relative error <= 2^-8; the router is E x H, a few MB at most, so its bytes do
not matter); its logits are fp32 as for a bf16 router. `reference.moe_forward(...,
rounding=...)` models that rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import formats, jit
from .catalog import WeightFormat
from .config import MoeConfig
from .host_weights import HostWeights


FORMAT_CODES = {f.label: int(f) for f in WeightFormat}
FORMAT_K_MULTIPLE = {f.label: f.k_multiple for f in WeightFormat}
FORMAT_BITS = {f.label: f.bits for f in WeightFormat}


from .errors import UnsupportedFormatError  # noqa: F401 (re-exported)


def _bf16_bits(t: Any, name: str):
    """A bf16 (or float32, rounded) array as contiguous uint16 bits: a host array, or a CuPy array
    kept on its device (uint16 is bf16 bits already; float32 / float16 is rounded there)."""
    if formats.on_device(t):
        if t.dtype == np.uint16:
            return t
        if t.dtype not in (np.float32, np.float16):
            raise UnsupportedFormatError(f"{name}: a device array must hold bf16 bits as uint16 (or float32 / "
                                         f"float16 values to round), found {t.dtype}")
        return _device_bf16_bits(t)
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


def _device_bf16_bits(t: Any):
    """float32 values rounded to bf16 (nearest even) on the device, as uint16 bits (values are finite:
    HostWeights.validate checked them)."""
    import cupy

    u = cupy.ascontiguousarray(t, dtype=cupy.float32).view(cupy.uint32)
    return ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)


def router_bf16(t: Any) -> Any:
    """The router as the kernels hold it: bf16 as given, or a quantized router dequantized
    (exactly, in float64) and rounded once to bf16 (a device router's few MB through the host)."""
    if formats.weight_format(t) == "bf16":
        return t
    return formats.dequantize(on_host(t), np.float64).astype(np.float32).astype(formats.BF16)


def on_host(t: Any) -> Any:
    """A quantized container with its device arrays copied to the host (small tensors only: the router)."""
    import dataclasses

    return type(t)(**{f.name: (v.get() if formats.on_device(v) else v)
                      for f in dataclasses.fields(t) for v in [getattr(t, f.name)]})


def _f32(t: Any) -> Any:
    if t is None:
        return None
    if formats.on_device(t):
        import cupy

        return t if t.dtype == np.float32 else t.astype(cupy.float32)
    return np.ascontiguousarray(np.asarray(t, dtype=np.float32))


@dataclass(frozen=True)
class WeightMemory:
    """The device memory a layer's weights take (MoeLayer.memory_report)."""

    owned: int  # bytes the layer allocated: copies, repacked fp4 codes, a dequantized router
    borrowed: int  # the caller's device arrays used where they lie (kept alive, never written)
    tables: int  # per-slot pointer tables and slot maps


BORROW_ALIGN = 16  # the kernels' 16-byte vector loads and TMA's global addresses; a view of a file may be less


class _Store:
    """The layer's device arrays: a caller's CuPy array already as the kernels read it (C-contiguous,
    on this device, 16-byte aligned) is borrowed and kept alive; anything else is copied, on the device
    for a device array (never through the host), uploaded for a host one."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.keep: list[Any] = []
        self.bytes = {"owned": 0, "borrowed": 0, "tables": 0}

    def take(self, a: Any, *, fresh: bool = False, table: bool = False, copy: bool = False) -> Any:
        """`fresh`: `a` was made for the layer (a conversion's result): it is owned; `copy`: always a
        copy (the fp4 repack writes it)."""
        if a is None:
            return None
        import cupy

        if (formats.on_device(a) and not copy and a.device.id == self.device_id and a.flags.c_contiguous
                and a.data.ptr % BORROW_ALIGN == 0):
            d, kind = a, "owned" if fresh else "borrowed"
        else:
            d, kind = cupy.array(a, copy=True, order="C"), "tables" if table else "owned"
        self.keep.append(d)
        self.bytes[kind] += int(d.nbytes)
        return d

    def memory(self) -> WeightMemory:
        return WeightMemory(**self.bytes)


@dataclass(frozen=True)
class MemoryReport:
    """The device memory a layer uses, in bytes (MoeLayer.memory_report)."""

    weights_owned: int  # weight arrays the layer allocated: uploads, device copies, repacked fp4, a dequantized router
    weights_borrowed: int  # the caller's device tensors used where they lie (kept alive, never written)
    tables: int  # per-slot pointer tables and slot maps
    layer_state: int  # the error word, the TMA tensor maps and the LoRA adapter slots
    scratch: int  # what the layer needs of its workspace (its scratch plan and zeroed region)
    workspace: int  # the workspace's allocation, shared by the layers bound to it

    @property
    def added(self) -> int:
        """What the layer allocated for itself, past the caller's tensors and the shared workspace."""
        return self.weights_owned + self.tables + self.layer_state


class DeviceWeights:
    def __init__(self, cfg: MoeConfig, hw: HostWeights, device_id: int, owned: Optional[Sequence[int]] = None):
        """`owned`: the routed experts this rank computes (default: the config's contiguous block)."""
        import cupy

        hw.validate(cfg)
        self.cfg = cfg
        owned = list(cfg.owned_experts() if owned is None else owned)
        self.n_local = len(owned)
        self._owned = owned
        self._store = _Store(device_id)
        with cupy.cuda.Device(device_id):
            self._vectors(hw)
            mats, biases = self._routed(hw, owned)
            tables, gscale, slot_fmt, inter = _slot_tables(cfg, self.n_local, self.format, mats, biases)
            ranges = [m.scale_bytes for m in mats.values() if m.scale_bytes is not None]
            ranges += self._shared(hw, tables, gscale, slot_fmt, inter)
            # the smallest and largest mxfp4 scale byte of every mxfp4 matrix (None: none):
            # the tensor-core decode serves a range of them (catalog.FP4_MMA_MXFP4_SCALE_BYTES)
            self.mxfp4_scale_bytes = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
            take = self._store.take
            self.tables = {k: take(v, table=True) for k, v in {**tables, **gscale}.items()}
            self.slot_fmt = take(slot_fmt, table=True)
            self.inter = take(inter, table=True)
        self.shared_slot = self.n_local
        self.i_max = int(inter.max())
        self._keep = self._store.keep
        self.nbytes = sum(int(d.nbytes) for d in self._keep)

    @property
    def memory(self) -> WeightMemory:
        return self._store.memory()

    def _vectors(self, hw: HostWeights) -> None:
        """The router, its biases, the norm weight, the shared-expert gate, the hash table, the slot map."""
        cfg, take = self.cfg, self._store.take
        # slot_of[e]: expert e's table slot here, -1 for other ranks' experts and zero experts
        slot_of = np.full(cfg.router_width, -1, np.int32)
        slot_of[self._owned] = np.arange(self.n_local, dtype=np.int32)
        self.slot_of = take(slot_of, table=True)
        router = router_bf16(hw.router)
        bits = _bf16_bits(router, "router")
        self.router = take(bits, fresh=router is not hw.router or bits is not router)
        for name in ("router_bias", "correction_bias", "norm_weight", "shared_expert_gate"):
            t = getattr(hw, name)
            v = _f32(t)
            setattr(self, name, take(v, fresh=v is not t))
        self.tid2eid = take(None if hw.tid2eid is None else _int32(hw.tid2eid))

    def _routed(self, hw: HostWeights, owned: list[int]) -> tuple[dict, tuple]:
        """The routed experts' matrices (stacked [n_local, ...]) and biases ([n_local, I], [n_local, H])."""
        sl = _selector(owned)
        fresh = not isinstance(sl, slice)  # an index array's gather is a new array
        self.format = _one_format({p: getattr(hw, p) for p in PROJECTIONS}, "routed experts")
        mats = {p: _DeviceMatrix(getattr(hw, p)[sl], p, p, self._store, fresh=fresh or p in hw.made_on_device)
                for p in PROJECTIONS}
        # the stacked routed experts ([n_local, I, H], [n_local, H, I]; bf16 bits, or the
        # quantized codes, fp4 words repacked), kept by name for code that reads them
        # whole (the torch peers, bf16 only)
        self.experts = {p: m.w for p, m in mats.items()}
        biases = []
        for name in ("gate_bias", "up_bias", "down_bias"):
            t = getattr(hw, name)
            t = None if t is None else t[sl]
            v = _f32(t)
            biases.append(self._store.take(v, fresh=fresh or v is not t))
        return mats, tuple(biases)

    def _shared(self, hw: HostWeights, tables: dict, gscale: dict, slot_fmt, inter) -> list:
        """The shared expert into slot n_local; returns its mxfp4 scale-byte range (if any) in a list."""
        cfg, n = self.cfg, self.n_local
        self.shared_format = None
        if not cfg.has_shared_expert:
            return []
        shared = {p: getattr(hw, "shared_" + p) for p in PROJECTIONS}
        self.shared_format = _one_format(shared, "the shared expert")
        ranges = []
        for p, t in shared.items():
            m = _DeviceMatrix(t, p, "shared_" + p, self._store, stacked=False)
            m.fill(tables, gscale, [n])
            if m.scale_bytes is not None:
                ranges.append(m.scale_bytes)
        inter[n] = cfg.shared_expert_intermediate_size
        slot_fmt[n] = FORMAT_CODES[self.shared_format]
        return ranges

    def ptr(self, name: str) -> int:
        """Raw pointer of a named device tensor (0 when the layer has none)."""
        d = self.tables[name] if name in self.tables else getattr(self, name)
        return 0 if d is None else int(d.data.ptr)


def _int32(t: Any) -> Any:
    if formats.on_device(t):
        return t.astype("int32")
    return np.ascontiguousarray(t, dtype=np.int32)


def _slot_tables(cfg: MoeConfig, n: int, fmt: str, mats: dict, biases: tuple) -> tuple:
    """The per-slot tables of the routed slots 0..n-1 (pointers, global scales, formats, widths);
    slot n, the shared expert's, stays zero here."""
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    slots = n + 1  # + the shared expert's slot (zeros when there is none)
    tables = {k: np.zeros(slots, np.uint64) for k in
              ("gate_bias", "up_bias", "down_bias") + PROJECTIONS + tuple(p + "_scale" for p in PROJECTIONS)}
    gscale = {p + "_gscale": np.ones(slots, np.float32) for p in PROJECTIONS}
    slot_fmt = np.zeros(slots, np.int32)
    inter = np.zeros(slots, np.int32)
    for m in mats.values():
        m.fill(tables, gscale, range(n))
    gb, ub, db = biases
    for e in range(n):
        if gb is not None:
            tables["gate_bias"][e] = int(gb.data.ptr) + e * I * 4
            tables["up_bias"][e] = int(ub.data.ptr) + e * I * 4
            tables["down_bias"][e] = int(db.data.ptr) + e * H * 4
        inter[e] = I
        slot_fmt[e] = FORMAT_CODES[fmt]
    return tables, gscale, slot_fmt, inter


PROJECTIONS = ("gate", "up", "down")


def _one_format(mats: dict, what: str) -> str:
    fmts = {p: formats.weight_format(t) for p, t in mats.items()}
    if len(set(fmts.values())) > 1:
        raise UnsupportedFormatError(f"{what}: gate, up and down must share one weight format, found {fmts}")
    return next(iter(fmts.values()))


class _DeviceMatrix:
    """One projection's weights on the device, stacked over experts (or one matrix), in its
    format: `w` the bf16 bits or the codes, `s` the scales, `g` the global scales. A caller's
    device arrays in that layout are borrowed (_Store); fp4 codes are always the layer's own copy
    (the repack rewrites them). `fresh`: `t`'s arrays were made for the layer (an expert gather)."""

    def __init__(self, t: Any, proj: str, name: str, store: _Store, stacked: bool = True, fresh: bool = False):
        self.proj = proj  # gate / up / down: the tables it fills
        fmt = formats.weight_format(t)
        if fmt not in FORMAT_CODES:
            raise UnsupportedFormatError(f"{name}: format {fmt!r} is not one the kernels read {sorted(FORMAT_CODES)}")
        shape = tuple(int(d) for d in t.shape)
        self.out, self.K = shape[-2], shape[-1]
        self.count = shape[0] if stacked else 1
        need = FORMAT_K_MULTIPLE[fmt]
        if self.K % need:
            raise UnsupportedFormatError(f"{name}: {fmt} weights need the input width to be a multiple of {need} "
                                         f"(the kernels read whole 16-byte chunks of codes), found {shape}")
        if fmt != "bf16" and not formats.on_device(getattr(t, "q", getattr(t, "packed", getattr(t, "blocks", None)))):
            t.check_scales(name)  # host arrays only: a CuPy container is the caller's own draw
        self.g = np.ones(self.count, np.float32)
        self.s = None
        self.scale_bytes = None  # mxfp4: (smallest, largest) scale byte

        def take(a, copy=False):
            return store.take(a, fresh=fresh, copy=copy)

        if fmt == "bf16":
            bits = _bf16_bits(t, name)
            self.w = store.take(bits, fresh=fresh or bits is not t)
        elif fmt == "fp8_block":
            self.w = take(_codes(t.q))
            self.s = take(t.scale_inv if formats.on_device(t.scale_inv)
                          else np.ascontiguousarray(t.scale_inv, dtype=np.float32))
        elif fmt == "nvfp4":
            self.w = _repack_fp4(take(_codes(t.packed), copy=True))
            self.s = take(_codes(t.scale))
            g = t.scale_2.get() if formats.on_device(t.scale_2) else t.scale_2
            self.g = np.asarray(g, np.float32).reshape(self.count)
        else:  # mxfp4: [.., out, K/32, 16] blocks are the [.., out, K/2] packed bytes
            self.w = _repack_fp4(take(_codes(t.blocks), copy=True))
            self.s = take(_codes(t.scales))
            self.scale_bytes = (int(self.s.min()), int(self.s.max())) if self.s.size else (127, 127)
        self.w_stride = self.out * self.K * FORMAT_BITS[fmt] // 8
        self.s_stride = 0 if self.s is None else int(self.s.nbytes) // self.count

    def fill(self, tables: dict, gscale: dict, slots) -> None:
        """Write this matrix's pointers and global scales into the per-slot tables."""
        p = self.proj
        for i, slot in enumerate(slots):
            tables[p][slot] = int(self.w.data.ptr) + i * self.w_stride
            if self.s is not None:
                tables[p + "_scale"][slot] = int(self.s.data.ptr) + i * self.s_stride
            gscale[p + "_gscale"][slot] = self.g[i]


def _repack_fp4(d):
    """A device copy of fp4 codes, each 32-bit word's bits repacked in place for the kernels
    (cuda/repack.cu, on the current stream; formats.repack_fp4_words is its host twin)."""
    n = int(d.nbytes) // 4
    if int(d.nbytes) % 4:
        raise UnsupportedFormatError(f"fp4 codes of {int(d.nbytes)} bytes: the kernels read whole 4-byte words")
    if n:
        fn = jit.library(d.device.id)["fp4_repack_words"]
        fn((min((n + 255) // 256, 1 << 16),), (256,), (d, np.uint64(n)))
    return d


def _codes(a: Any):
    """Quantized codes / scales as raw uint8 (host e4m3 arrays viewed as bytes), or a
    CuPy array as it is."""
    if formats.on_device(a):
        return a
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _selector(owned: list[int]):
    """Index of the owned experts along the stacked expert axis: a slice when contiguous
    (a view, no host copy), else an index array."""
    if owned and owned == list(range(owned[0], owned[-1] + 1)):
        return slice(owned[0], owned[-1] + 1)
    return np.asarray(owned, dtype=np.int64)
