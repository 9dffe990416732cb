"""Device weights and the per-expert pointer tables the kernels read.

Made once at load. The routed experts this rank owns are uploaded as stacked arrays
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

A quantized router (fp8_block, nvfp4) is dequantized once here to bf16, rounding each
weight once (relative error <= 2^-8; the router is E x H, a few MB at most, so its bytes do
not matter); its logits are fp32 as for a bf16 router. `reference.moe_forward(...,
rounding=...)` models that rounding.
"""

from __future__ import annotations

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


def router_bf16(t: Any) -> Any:
    """The router as the kernels hold it: bf16 as given, or a quantized router dequantized
    (exactly, in float64) and rounded once to bf16."""
    if formats.weight_format(t) == "bf16":
        return t
    if formats.on_device(getattr(t, "q", getattr(t, "packed", None))):
        raise UnsupportedFormatError(f"router: a quantized router ({formats.weight_format(t)}) must hold host "
                                     "(numpy) arrays, found CuPy arrays: it is dequantized on the host at load")
    return formats.dequantize(t, np.float64).astype(np.float32).astype(formats.BF16)


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
            self.router = up(_bf16_bits(router_bf16(hw.router), "router"))
            self.router_bias = up(_f32(hw.router_bias))
            self.correction_bias = up(_f32(hw.correction_bias))
            self.norm_weight = up(_f32(hw.norm_weight))
            self.shared_expert_gate = up(_f32(hw.shared_expert_gate))
            self.tid2eid = up(None if hw.tid2eid is None else np.ascontiguousarray(hw.tid2eid, dtype=np.int32))

            self.format = _one_format({p: getattr(hw, p) for p in PROJECTIONS}, "routed experts")
            mats = {p: _DeviceMatrix(getattr(hw, p)[sl], p, p, up) for p in PROJECTIONS}
            # the smallest and largest mxfp4 scale byte of every mxfp4 matrix (None: none):
            # the tensor-core decode serves a range of them (catalog.FP4_MMA_MXFP4_SCALE_BYTES)
            self.mxfp4_scale_bytes = None
            ranges = [m.scale_bytes for m in mats.values() if m.scale_bytes is not None]
            # the stacked routed experts ([n_local, I, H], [n_local, H, I]; bf16 bits, or the
            # quantized codes, fp4 words repacked), kept by name for code that reads them
            # whole (the torch peers, bf16 only)
            self.experts = {p: m.w for p, m in mats.items()}
            gb = up(_f32(None if hw.gate_bias is None else hw.gate_bias[sl]))
            ub = up(_f32(None if hw.up_bias is None else hw.up_bias[sl]))
            db = up(_f32(None if hw.down_bias is None else hw.down_bias[sl]))

            I = cfg.moe_intermediate_size
            n = self.n_local
            slots = n + 1  # + the shared expert's slot (zeros when there is none)
            tables = {k: np.zeros(slots, np.uint64) for k in
                      ("gate_bias", "up_bias", "down_bias") + PROJECTIONS + tuple(p + "_scale" for p in PROJECTIONS)}
            gscale = {p + "_gscale": np.ones(slots, np.float32) for p in PROJECTIONS}
            slot_fmt = np.zeros(slots, np.int32)
            inter = np.zeros(slots, np.int32)
            for m in mats.values():
                m.fill(tables, gscale, range(n))
            for e in range(n):
                if gb is not None:
                    tables["gate_bias"][e] = ptr(gb) + e * I * 4
                    tables["up_bias"][e] = ptr(ub) + e * I * 4
                    tables["down_bias"][e] = ptr(db) + e * cfg.hidden_size * 4
                inter[e] = I
                slot_fmt[e] = FORMAT_CODES[self.format]
            self.shared_format = None
            if cfg.has_shared_expert:
                shared = {p: getattr(hw, "shared_" + p) for p in PROJECTIONS}
                self.shared_format = _one_format(shared, "the shared expert")
                for p, t in shared.items():
                    m = _DeviceMatrix(t, p, "shared_" + p, up, stacked=False)
                    m.fill(tables, gscale, [n])
                    if m.scale_bytes is not None:
                        ranges.append(m.scale_bytes)
                inter[n] = cfg.shared_expert_intermediate_size
                slot_fmt[n] = FORMAT_CODES[self.shared_format]
            if ranges:
                self.mxfp4_scale_bytes = (min(r[0] for r in ranges), max(r[1] for r in ranges))
            self.tables = {k: up(v) for k, v in {**tables, **gscale}.items()}
            self.slot_fmt = up(slot_fmt)
            self.inter = up(inter)
        self.shared_slot = n
        self.i_max = int(inter.max())
        self.nbytes = sum(int(d.nbytes) for d in self._keep)

    def ptr(self, name: str) -> int:
        """Raw pointer of a named device tensor (0 when the layer has none)."""
        d = self.tables[name] if name in self.tables else getattr(self, name)
        return 0 if d is None else int(d.data.ptr)


PROJECTIONS = ("gate", "up", "down")


def _one_format(mats: dict, what: str) -> str:
    fmts = {p: formats.weight_format(t) for p, t in mats.items()}
    if len(set(fmts.values())) > 1:
        raise UnsupportedFormatError(f"{what}: gate, up and down must share one weight format, found {fmts}")
    return next(iter(fmts.values()))


class _DeviceMatrix:
    """One projection's weights on the device, stacked over experts (or one matrix), in its
    format: `w` the bf16 bits or the codes, `s` the scales, `g` the global scales."""

    def __init__(self, t: Any, proj: str, name: str, upload, stacked: bool = True):
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
        if fmt == "bf16":
            self.w = upload(_bf16_bits(t, name))
        elif fmt == "fp8_block":
            self.w = upload(_codes(t.q))
            self.s = upload(t.scale_inv if formats.on_device(t.scale_inv)
                            else np.ascontiguousarray(t.scale_inv, dtype=np.float32))
        elif fmt == "nvfp4":
            self.w = _repack_fp4(upload(_codes(t.packed)))
            self.s = upload(_codes(t.scale))
            self.g = np.asarray(t.scale_2, np.float32).reshape(self.count)
        else:  # mxfp4: [.., out, K/32, 16] blocks are the [.., out, K/2] packed bytes
            self.w = _repack_fp4(upload(_codes(t.blocks)))
            self.s = upload(_codes(t.scales))
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
