"""Weight formats on the host: quantize, dequantize and pack (numpy + ml_dtypes).

Bit-exact to FORMATS.md. Every container keeps the logical [..., out, in] shape of the
matrix it stands for (leading axes stack experts), so `HostWeights` can hold plain bf16
arrays and quantized weights side by side and `.shape` means the same for both.

| format    | container       | stored                                                       |
|-----------|-----------------|--------------------------------------------------------------|
| bf16      | np.ndarray      | ml_dtypes.bfloat16 [..., out, in]                            |
| fp8_block | Fp8BlockWeight  | q e4m3fn [..., out, in]; scale_inv f32 [..., ceil(out/128), ceil(in/128)] |
| nvfp4     | Nvfp4Weight     | packed u8 [..., out, in/2] (element 2j low nibble); scale e4m3fn [..., out, in/16]; scale_2 f32 [...] |
| mxfp4     | Mxfp4Weight     | blocks u8 [..., out, in/32, 16] (element 2j low nibble); scales u8 (e8m0) [..., out, in/32] |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import ml_dtypes
import numpy as np

from .errors import OptionError, WeightError

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
NVFP4_GROUP = 16
MXFP4_GROUP = 32

# e2m1 code -> value (FORMATS.md): 0..7 positive, 8..15 their negatives.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


# ----------------------------------------------------------------------------------
# e2m1 codes and nibble packing
# ----------------------------------------------------------------------------------

def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes (any integer array, values 0..15) -> float32 values."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def e2m1_encode(values: np.ndarray) -> np.ndarray:
    """float values -> nearest e2m1 code (ties to even, saturating at +-6), uint8 0..15."""
    v = np.clip(np.asarray(values, dtype=np.float32), -E2M1_MAX, E2M1_MAX)
    return v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 2n] codes -> [..., n] bytes, element 2j in the low nibble, 2j+1 in the high one."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise WeightError(f"pack_nibbles: last axis must be even, found {c.shape}")
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] codes (inverse of pack_nibbles)."""
    p = np.asarray(packed, dtype=np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


# ----------------------------------------------------------------------------------
# the fp4 device layout: each 32-bit word's bits repacked for the kernels
# ----------------------------------------------------------------------------------
# The GPU kernels read fp4 codes a 32-bit word at a time (8 codes of a row, code i in
# nibble i as stored) and turn code i and code i + 4 into one bf16x2 pair by placing bits:
# magnitude bits (e1 e0 m) at bf16 bits 8..6, the sign at bit 15, each half (the value times
# 2^-126, cuda/quant.cuh fp4x8_to_bf16_pairs). On the stored nibbles that takes 13 integer
# operations a word; the load repacks each word's bits once (cupymoe/weights.py, on the
# device: cuda/repack.cu) so that it takes 8: decode_wgmma_fp4.cu's stage went from 844 to
# 684 instructions and the fp4 decode 3-12 % faster (NOTES.md v40):
#   pair 0 (codes 0, 4): the bits where bf16 wants them, so one mask;
#   pairs 1 and 2 (codes 1, 5 and 2, 6): the same rotated left by 3 and by 6, so a rotate and a mask;
#   pair 3 (codes 3, 7): e1 at bit 0, the sign at 1, m at 3, e0 at 4 (and + 16), which a mask,
#     x * (2^3 + 2^8 + 2^14) (three copies that cannot overlap) and a mask put in place.
# No layout makes every pair one shift and one mask (scripts/fp4_pair_tiling.py): pair 3 is the
# one that takes the multiply. Only the bits inside each word move: sizes, strides, scales and
# the row layout stay the checkpoint's, and an all-zero word (the kernels' padding) stays zero.

FP4_PAIR_BITS = (6, 7, 8, 15)  # a bf16 half's bits for a code's m, e0, e1, sign
FP4_PAIR3_BITS = (3, 4, 0, 1)  # pair 3's stored bits for m, e0, e1, sign (low half; + 16 high)
FP4_PAIR_ROTATION = (0, 3, 6)  # pairs 0, 1, 2: left rotation of the bf16 placement


def fp4_word_bit_map() -> np.ndarray:
    """[32] int: device bit of each stored bit (4 i + b: code i's bit b, b = 0 m, 1 e0, 2 e1, 3 sign)."""
    dest = np.empty(32, np.int64)
    for i in range(8):
        pair, half = i % 4, 16 * (i // 4)
        for b in range(4):
            if pair < 3:
                dest[4 * i + b] = (FP4_PAIR_BITS[b] + half + FP4_PAIR_ROTATION[pair]) % 32
            else:
                dest[4 * i + b] = FP4_PAIR3_BITS[b] + half
    assert sorted(dest) == list(range(32))  # a permutation of the word's bits
    return dest


def _permute_word_bits(words: np.ndarray, dest: np.ndarray) -> np.ndarray:
    out = np.zeros_like(words)
    for src, d in enumerate(dest):
        out |= ((words >> np.uint32(src)) & np.uint32(1)) << np.uint32(d)
    return out


def _fp4_words(packed: np.ndarray, who: str) -> np.ndarray:
    p = np.ascontiguousarray(np.asarray(packed))
    if p.dtype != np.uint8 or p.shape[-1] % 4:
        raise WeightError(f"{who}: packed fp4 bytes (uint8) with a whole number of 4-byte words a row, "
                         f"found {p.dtype} {p.shape}")
    return p.view(np.uint32)


def repack_fp4_words(packed: np.ndarray) -> np.ndarray:
    """Packed fp4 codes (uint8 [..., n], n a multiple of 4) as the GPU holds them: each
    little-endian 32-bit word's bits moved by fp4_word_bit_map (the host twin of
    cuda/repack.cu, for tests and tools)."""
    return _permute_word_bits(_fp4_words(packed, "repack_fp4_words"), fp4_word_bit_map()).view(np.uint8)


def unrepack_fp4_words(words: np.ndarray) -> np.ndarray:
    """The inverse of repack_fp4_words: device-layout bytes back to the stored nibbles."""
    inverse = np.argsort(fp4_word_bit_map())
    return _permute_word_bits(_fp4_words(words, "unrepack_fp4_words"), inverse).view(np.uint8)


# ----------------------------------------------------------------------------------
# containers
# ----------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_scales(name: str, field: str, values: np.ndarray, bad: np.ndarray) -> None:
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        v = values[idx]
        shown = f"byte 0x{int(v):02X}" if values.dtype == np.uint8 else repr(float(v))
        raise WeightError(f"{name}.{field}[{', '.join(map(str, idx))}] = {shown}: not a usable scale "
                         f"({int(bad.sum())} such in {values.size}); the checkpoint is corrupt or mis-read")


def on_device(a: Any) -> bool:
    """A CuPy array: the containers accept device arrays as they are (no dequantize then)."""
    return type(a).__module__.startswith("cupy")


def _check_device(a: Any, dtype, what: str) -> None:
    if not on_device(a) or a.dtype != dtype:
        raise WeightError(f"{what}: a container built from CuPy arrays needs every array on the device as "
                         f"{np.dtype(dtype).name}, found {type(a).__name__} {getattr(a, 'dtype', '')}")


def _bytes(a: Any, what: str) -> np.ndarray:
    """`a` as uint8: uint8 as it is, another integer dtype whose values all fit a byte; else
    (floats, or integers a cast would wrap, 256 -> 0, -1 -> 255) a ValueError naming it."""
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind not in "iu":
        raise WeightError(f"{what}: expected uint8 bytes, found dtype {a.dtype}")
    outside = (a < 0) | (a > 255)
    if outside.any():
        i = tuple(int(v) for v in np.argwhere(outside)[0])
        raise WeightError(f"{what}: expected byte values 0..255, found {a[i]} at {i}")
    return a.astype(np.uint8)


def _per_matrix(v: Any, lead: tuple[int, ...], what: str) -> np.ndarray:
    """A per-matrix float32 scalar broadcast over the leading (expert) dimensions `lead`."""
    a = np.asarray(v, dtype=np.float32)
    try:
        return np.broadcast_to(a, lead).copy()
    except ValueError:
        raise WeightError(f"{what}: expected one value per matrix, shape {lead} (or a scalar), "
                         f"found shape {a.shape}") from None


@dataclass
class Fp8BlockWeight:
    """DeepSeek-V3 fp8: W[i, j] = q[i, j] * scale_inv[i // 128, j // 128]."""

    q: np.ndarray  # float8_e4m3fn [..., out, in]
    scale_inv: np.ndarray  # float32 [..., ceil(out/128), ceil(in/128)]
    format = "fp8_block"

    def __post_init__(self) -> None:
        if on_device(self.q):  # CuPy arrays (the benchmark's weights) stay on the device
            _check_device(self.q, np.uint8, "Fp8BlockWeight.q (e4m3 bits)")
            _check_device(self.scale_inv, np.float32, "Fp8BlockWeight.scale_inv")
            return
        self.q = np.asarray(self.q)
        if self.q.dtype != E4M3:
            if self.q.dtype == np.uint8:
                self.q = self.q.view(E4M3)
            else:
                raise WeightError(f"Fp8BlockWeight.q: expected float8_e4m3fn, found {self.q.dtype}")
        self.scale_inv = np.asarray(self.scale_inv, dtype=np.float32)
        if self.q.ndim < 2:
            raise WeightError(f"Fp8BlockWeight.q: expected [..., out, in], found shape {self.q.shape}")
        out, inn = self.q.shape[-2:]
        want = self.q.shape[:-2] + (_ceil_div(out, FP8_BLOCK), _ceil_div(inn, FP8_BLOCK))
        if self.scale_inv.shape != want:
            raise WeightError(f"Fp8BlockWeight.scale_inv: expected shape {want} for q {self.q.shape}, "
                             f"found {self.scale_inv.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale_inv.nbytes

    def __getitem__(self, idx) -> "Fp8BlockWeight":
        """Index the leading (expert) axes only; rows of one matrix share block scales."""
        return Fp8BlockWeight(self.q[idx], self.scale_inv[idx])

    def check_scales(self, name: str) -> None:
        """Raise ValueError naming the first non-finite block scale (a corrupt or mis-read
        checkpoint would otherwise give NaN outputs, silently)."""
        _check_scales(name, "scale_inv", self.scale_inv, ~np.isfinite(self.scale_inv))

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        out, inn = self.q.shape[-2:]
        s = np.repeat(np.repeat(self.scale_inv, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :out, :inn]
        # the product in float64 is exact; cast once at the end
        return (self.q.astype(np.float64) * s).astype(dtype)


@dataclass
class Nvfp4Weight:
    """ModelOpt NVFP4: W[i, j] = e2m1(q[i, j]) * float(scale[i, j // 16]) * scale_2."""

    packed: np.ndarray  # uint8 [..., out, in/2]
    scale: np.ndarray  # float8_e4m3fn [..., out, in/16]
    scale_2: np.ndarray  # float32 [...]: one global scale per matrix
    input_scale: Optional[np.ndarray] = None  # float32 [...], kept for W4A4 users; W4A16 ignores it
    format = "nvfp4"

    def __post_init__(self) -> None:
        if on_device(self.packed):
            _check_device(self.packed, np.uint8, "Nvfp4Weight.packed")
            _check_device(self.scale, np.uint8, "Nvfp4Weight.scale (e4m3 bits)")
            self.scale_2 = np.broadcast_to(np.asarray(self.scale_2, dtype=np.float32), self.packed.shape[:-2]).copy()
            return
        self.packed = _bytes(self.packed, "Nvfp4Weight.packed")
        if self.packed.ndim < 2:
            raise WeightError(f"Nvfp4Weight.packed: expected [..., out, in/2], found shape {self.packed.shape}")
        self.scale = np.asarray(self.scale)
        if self.scale.dtype == np.uint8:
            self.scale = self.scale.view(E4M3)
        if self.scale.dtype != E4M3:
            raise WeightError(f"Nvfp4Weight.scale: expected float8_e4m3fn, found {self.scale.dtype}")
        lead = self.packed.shape[:-2]
        self.scale_2 = _per_matrix(self.scale_2, lead, "Nvfp4Weight.scale_2")
        if self.input_scale is not None:
            self.input_scale = _per_matrix(self.input_scale, lead, "Nvfp4Weight.input_scale")
        inn = self.packed.shape[-1] * 2
        if inn % NVFP4_GROUP:
            raise WeightError(f"Nvfp4Weight: in={inn} is not a multiple of {NVFP4_GROUP}")
        want = self.packed.shape[:-1] + (inn // NVFP4_GROUP,)
        if self.scale.shape != want:
            raise WeightError(f"Nvfp4Weight.scale: expected shape {want} for packed {self.packed.shape}, "
                             f"found {self.scale.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.packed.shape[:-1]) + (self.packed.shape[-1] * 2,)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.scale_2.nbytes

    def __getitem__(self, idx) -> "Nvfp4Weight":
        isc = None if self.input_scale is None else np.asarray(self.input_scale)[idx]
        return Nvfp4Weight(self.packed[idx], self.scale[idx], self.scale_2[idx], isc)

    def check_scales(self, name: str) -> None:
        """Raise ValueError naming the first NaN e4m3 group scale or non-finite scale_2."""
        bits = self.scale.view(np.uint8)
        _check_scales(name, "weight_scale", bits, (bits & 0x7F) == 0x7F)
        _check_scales(name, "weight_scale_2", self.scale_2, ~np.isfinite(self.scale_2))

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        vals = e2m1_decode(unpack_nibbles(self.packed)).astype(np.float64)
        s = np.repeat(self.scale.astype(np.float64), NVFP4_GROUP, axis=-1)
        return (vals * s * self.scale_2.astype(np.float64)[..., None, None]).astype(dtype)


@dataclass
class Mxfp4Weight:
    """OCP MX fp4 (gpt-oss): W[..., i, j] = e2m1(code) * 2^(scales[..., i, j // 32] - 127)."""

    blocks: np.ndarray  # uint8 [..., out, in/32, 16]
    scales: np.ndarray  # uint8 [..., out, in/32] (e8m0 biased exponents)
    format = "mxfp4"

    def __post_init__(self) -> None:
        if on_device(self.blocks):
            _check_device(self.blocks, np.uint8, "Mxfp4Weight.blocks")
            _check_device(self.scales, np.uint8, "Mxfp4Weight.scales")
            return
        self.blocks = _bytes(self.blocks, "Mxfp4Weight.blocks")
        sc = np.asarray(self.scales)
        if sc.dtype.name == "float8_e8m0fnu":  # the same bytes
            self.scales = sc.view(np.uint8)
        elif sc.dtype.itemsize == 1 and sc.dtype != np.uint8:
            # another 1-byte dtype's bits (int8, bool, e4m3 / e5m2) are no e8m0 exponents
            raise WeightError(f"Mxfp4Weight.scales: expected uint8 or float8_e8m0fnu e8m0 exponents, found {sc.dtype}")
        else:  # biased exponents as integers of any width, each 0..255 (2^(e - 127) values are not)
            self.scales = _bytes(sc, "Mxfp4Weight.scales (e8m0 biased exponents)")
        if self.blocks.ndim < 3 or self.blocks.shape[-1] != MXFP4_GROUP // 2:
            raise WeightError(f"Mxfp4Weight.blocks: expected [..., out, in/32, 16], found {self.blocks.shape}")
        if self.scales.shape != self.blocks.shape[:-1]:
            raise WeightError(f"Mxfp4Weight.scales: expected shape {self.blocks.shape[:-1]}, found {self.scales.shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.blocks.shape[:-2]) + (self.blocks.shape[-2] * MXFP4_GROUP,)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def __getitem__(self, idx) -> "Mxfp4Weight":
        return Mxfp4Weight(self.blocks[idx], self.scales[idx])

    def check_scales(self, name: str) -> None:
        """Raise ValueError naming the first e8m0 scale 255 (the format's NaN)."""
        _check_scales(name, "scales", self.scales, self.scales == 255)

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        vals = e2m1_decode(unpack_nibbles(self.blocks)).astype(np.float64)  # [..., out, in/32, 32]
        # the product in float64 is exact (6 * 2^127 is no float32); cast once at the end
        scale = np.ldexp(1.0, self.scales.astype(np.int32) - 127)
        return (vals * scale[..., None]).reshape(self.shape).astype(dtype)


QuantWeight = Union[Fp8BlockWeight, Nvfp4Weight, Mxfp4Weight]


def weight_format(t: Any) -> str:
    """'bf16' for plain arrays (bf16 or float32), else the container's format name."""
    return getattr(t, "format", "bf16")


def dequantize(t: Any, dtype=np.float64) -> np.ndarray:
    """Any weight (plain array or container) -> its dequantized values as `dtype`."""
    if hasattr(t, "dequantize"):
        return t.dequantize(dtype)
    return np.asarray(t).astype(dtype)


# ----------------------------------------------------------------------------------
# quantizers
# ----------------------------------------------------------------------------------

def _blocks_2d(w: np.ndarray, bo: int, bi: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Pad [..., out, in] to whole blocks and view as [..., out/bo, bo, in/bi, bi]."""
    out, inn = w.shape[-2:]
    po, pi = _ceil_div(out, bo) * bo, _ceil_div(inn, bi) * bi
    pad = [(0, 0)] * (w.ndim - 2) + [(0, po - out), (0, pi - inn)]
    wp = np.pad(w, pad)
    return wp.reshape(w.shape[:-2] + (po // bo, bo, pi // bi, bi)), (out, inn)


def _quantizer_input(w: Any, who: str) -> np.ndarray:
    """A float matrix (stack) as float32, refusing what no format encodes: fewer than two
    axes, and NaN or infinite weights (they would become finite codes, or NaN codes that
    no scale check sees, and take their block's scale with them)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim < 2:
        raise WeightError(f"{who}: expected a [..., out, in] matrix (stack), found shape {w.shape}")
    bad = ~np.isfinite(w)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise WeightError(f"{who}: weight{list(idx)} = {w[idx]}: only finite weights can be quantized")
    return w


def _scale_for(amax: np.ndarray, qmax: float, top: np.ndarray) -> np.ndarray:
    """float32 scales amax / qmax (1 for all-zero blocks), each raised to the next float32
    above where `top / s`, the largest value the quantizer will divide by it, would not
    survive as e4m3: where amax / qmax is no float32 above zero, or rounds so far down that
    top / s rounds past 448 (float32 subnormal magnitudes, ~1e-38 and below). Before, such
    blocks quantized to e4m3 NaNs that no scale check sees."""
    amax = np.asarray(amax, dtype=np.float32)
    s = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(np.finfo(np.float32).smallest_subnormal))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for _ in range(4):  # one step up suffices; a few guard against double rounding
            over = ~np.isfinite((top / s).astype(E4M3))
            if not over.any():
                return s
            s = np.where(over, np.nextafter(s, np.float32(np.inf)), s)
    raise AssertionError("unreachable: a float32 step up brings the block back into e4m3's range")


def quantize_fp8_block(w: np.ndarray) -> Fp8BlockWeight:
    """Per-128x128-block absmax scaling to e4m3 (DeepSeek-V3's scheme)."""
    w = _quantizer_input(w, "quantize_fp8_block")
    blk, (out, inn) = _blocks_2d(w, FP8_BLOCK, FP8_BLOCK)
    amax = np.abs(blk).max(axis=(-3, -1), initial=0.0)  # [..., out/128, in/128]
    scale = _scale_for(amax, E4M3_MAX, amax)
    q = (blk / scale[..., :, None, :, None]).astype(E4M3)
    q = q.reshape(blk.shape[:-4] + (blk.shape[-4] * FP8_BLOCK, blk.shape[-2] * FP8_BLOCK))[..., :out, :inn]
    return Fp8BlockWeight(np.ascontiguousarray(q), scale)


def quantize_nvfp4(w: np.ndarray) -> Nvfp4Weight:
    """ModelOpt NVFP4: global scale_2 = amax / (448 * 6); e4m3 scale per 16; e2m1 values."""
    w = _quantizer_input(w, "quantize_nvfp4")
    out, inn = w.shape[-2:]
    if inn % NVFP4_GROUP:
        raise WeightError(f"quantize_nvfp4: in={inn} is not a multiple of {NVFP4_GROUP}")
    amax = np.abs(w).max(axis=(-2, -1), initial=0.0)
    # every group scale gmax / 6 / scale_2 below must be an e4m3 number, the largest too
    scale_2 = _scale_for(amax, E4M3_MAX * E2M1_MAX, amax / E2M1_MAX)
    g = w.reshape(w.shape[:-1] + (inn // NVFP4_GROUP, NVFP4_GROUP))
    gmax = np.abs(g).max(axis=-1)
    s = (gmax / E2M1_MAX / scale_2[..., None, None]).astype(E4M3)  # rounds to e4m3
    sf = s.astype(np.float32) * scale_2[..., None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(sf[..., None] > 0, g / sf[..., None], 0.0)
    codes = e2m1_encode(v).reshape(w.shape)
    return Nvfp4Weight(pack_nibbles(codes), s, scale_2)


def quantize_mxfp4(w: np.ndarray) -> Mxfp4Weight:
    """OCP MX: shared exponent floor(log2(amax)) - 2 per 32 elements (e2m1's emax is 2)."""
    w = _quantizer_input(w, "quantize_mxfp4")
    out, inn = w.shape[-2:]
    if inn % MXFP4_GROUP:
        raise WeightError(f"quantize_mxfp4: in={inn} is not a multiple of {MXFP4_GROUP}")
    g = w.reshape(w.shape[:-1] + (inn // MXFP4_GROUP, MXFP4_GROUP))
    gmax = np.abs(g).max(axis=-1)
    # floor(log2(gmax)) exactly, from the binary exponent: float32 log2 rounds values just
    # below a power of two up to it (frexp: gmax = m * 2^x with m in [0.5, 1))
    e = np.where(gmax > 0, np.frexp(gmax)[1] - 1 - 2, -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    v = g / np.ldexp(np.float32(1), e)[..., None]
    codes = e2m1_encode(v)
    return Mxfp4Weight(pack_nibbles(codes), (e + 127).astype(np.uint8))


QUANTIZERS = {"fp8_block": quantize_fp8_block, "nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}


def quantize(w: np.ndarray, fmt: str) -> Any:
    """Quantize a float matrix (stack) to `fmt`; 'bf16' rounds to bfloat16."""
    if fmt == "bf16":
        return np.asarray(w, dtype=np.float32).astype(BF16)
    if fmt not in QUANTIZERS:
        raise OptionError(f"quantize: unknown format {fmt!r}; known: bf16, {', '.join(QUANTIZERS)}")
    return QUANTIZERS[fmt](w)
