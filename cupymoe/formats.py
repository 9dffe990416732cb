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

import os
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
# device: cuda/repack.cu) so that it takes 8 (the figures: benchmarks/DECISIONS.md):
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


def on_device(a: Any) -> bool:
    """A CuPy array: the containers accept device arrays as they are (no dequantize then)."""
    return type(a).__module__.startswith("cupy")


def _check_device(a: Any, dtype, what: str) -> None:
    if not on_device(a) or a.dtype != dtype:
        raise WeightError(f"{what}: a container built from CuPy arrays needs every array on the device as "
                         f"{np.dtype(dtype).name}, found {type(a).__name__} {getattr(a, 'dtype', '')}")


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def _expect_shape(a: Any, want: tuple[int, ...], what: str, for_what: Optional[str] = None) -> None:
    """Shape check through `.shape` only, so a CuPy array is checked where it lies."""
    if _shape(a) != want:
        raise WeightError(f"{what}: expected shape {want}{f' for {for_what}' if for_what else ''}, found {_shape(a)}")


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


# ----------------------------------------------------------------------------------
# value checks: on the raw bits, in chunks, numpy or CuPy
# ----------------------------------------------------------------------------------
# The kernels would turn NaN weights or unusable scales into NaN (or silently zeroed) outputs.

CHECK_CHUNK = 1 << 20  # elements a step on the host: large enough to amortise the call, cached for the second pass
DEVICE_CHECK_CHUNK = 1 << 26  # on the device: few launches, a bounded temporary
_PARALLEL_SPAN = 1 << 24  # elements a thread's task on the host

# float dtype -> (unsigned view, signed view, the smallest magnitude bits of an Inf or NaN)
_NONFINITE_BITS = {
    BF16: (np.uint16, np.int16, 0x7F80),
    np.dtype(np.float16): (np.uint16, np.int16, 0x7C00),
    np.dtype(np.float32): (np.uint32, np.int32, 0x7F800000),
    np.dtype(np.float64): (np.uint64, np.int64, 0x7FF0000000000000),
    E4M3: (np.uint8, np.int8, 0x7F),  # e4m3fn: no Inf; S.1111.111 is NaN
}


def _pieces(a: Any, chunk: int, offset: int = 0):
    """(flat C-order offset, 1-D piece) covering `a`; a piece is a view where `a` is contiguous,
    else a copy of at most `chunk` elements (or one row of the last axis)."""
    shape = _shape(a)
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
        return
    if a.flags.c_contiguous or size <= chunk:
        flat = a.reshape(-1)
        for s in range(0, size, chunk):
            yield offset + s, flat[s:s + chunk]
        return
    row = size // shape[0]
    step = max(1, chunk // row)
    for i in range(0, shape[0], step):
        sub = a[i] if step == 1 else a[i:i + step]
        yield from _pieces(sub, chunk, offset + i * row)


def _first_hit(bits: Any, hit: Any) -> Optional[int]:
    """Flat index of the first element of `bits` that `hit(piece) -> Optional[int]` reports."""
    if on_device(bits):
        chunk = DEVICE_CHECK_CHUNK
    else:
        chunk = CHECK_CHUNK
        size = bits.size
        if size >= 2 * _PARALLEL_SPAN and bits.flags.c_contiguous and (os.cpu_count() or 1) > 1:
            flat = bits.reshape(-1)

            def span(start: int) -> Optional[int]:
                end = min(start + _PARALLEL_SPAN, size)
                for s in range(start, end, chunk):
                    i = hit(flat[s:min(s + chunk, end)])
                    if i is not None:
                        return s + i
                return None

            from concurrent.futures import ThreadPoolExecutor

            # a pool per call (arrays this large take far longer than starting it): none outlives a fork
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                # in order, so the first hit reported is the first in the array
                return next((i for i in pool.map(span, range(0, size, _PARALLEL_SPAN)) if i is not None), None)
    for off, piece in _pieces(bits, chunk):
        i = hit(piece)
        if i is not None:
            return off + i
    return None


def _magnitude_hit(signed, floor: int, sign: int):
    """hit() for 'the bits below the sign are >= floor' (Inf / NaN codes): two max-reductions a
    chunk (unsigned: negative ones, signed: positive ones), no temporaries; the mask is built
    only for the chunk that holds one."""
    def hit(piece: Any) -> Optional[int]:
        if int(piece.max()) >= sign | floor or int(piece.view(signed).max()) >= floor:
            return int(((piece & (sign - 1)) >= floor).argmax())
        return None

    return hit


def _at(flat: int, shape: tuple[int, ...]) -> str:
    """'[i, j, k]' of a flat index ('' for a scalar)."""
    return f"[{', '.join(str(int(i)) for i in np.unravel_index(flat, shape))}]" if shape else ""


def _element(bits: Any, flat: int) -> int:
    shape = _shape(bits)
    return int(bits[tuple(int(i) for i in np.unravel_index(flat, shape))] if shape else bits[()])


def _float_dtype(a: Any, what: str) -> np.dtype:
    """The float dtype `a` holds: a CuPy uint16 array holds bf16 bits (CuPy has no bfloat16)."""
    dt = np.dtype(a.dtype)
    if dt == np.uint16 and on_device(a):
        return BF16
    if dt not in _NONFINITE_BITS or dt == E4M3:
        raise WeightError(f"{what}: expected a float array (bf16, float16, float32 or float64), found dtype {dt}")
    return dt


def check_finite(a: Any, what: str) -> None:
    """WeightError naming the first Inf or NaN of a float array (bf16 / f16 / f32 / f64, a CuPy
    uint16 array as bf16 bits), its index and value; `what` names the tensor.

    Like every check here it reads the array once, as unsigned integers (no float temporaries),
    a chunk at a time so its scratch stays small; large host arrays are split over threads
    (numpy's reductions release the GIL); a CuPy array is checked on its device through its
    own methods, only scalars coming back."""
    dt = _float_dtype(a, what)
    _check_codes(a, dt, what, "not finite")


def check_e4m3_codes(a: Any, what: str) -> None:
    """WeightError naming the first e4m3 NaN code (0x7F / 0xFF) of fp8 weights (e4m3 or uint8 bytes)."""
    _check_codes(a, E4M3, what, "an e4m3 NaN code")


def _overflow_floor(dt: np.dtype, narrow: np.dtype) -> int:
    """The magnitude bits of `dt` from which rounding to `narrow` (float64 through float32, as the
    uploads round) gives Inf: the midpoint past `narrow`'s largest finite value (a tie rounds up, to even)."""
    info = ml_dtypes.finfo(narrow) if narrow == BF16 else np.finfo(narrow)
    mid = float(info.max) + 2.0 ** (int(info.maxexp) - 2 - int(info.nmant))  # the largest + half its ulp
    if dt == np.float64 and narrow == BF16:  # through float32 first: from the float32 below mid's halfway
        mid -= 2.0 ** (int(np.finfo(np.float32).maxexp) - 2 - int(np.finfo(np.float32).nmant))
    if dt == np.float32:
        return int(np.array(mid, np.float32).view(np.uint32))
    return int(np.array(mid, np.float64).view(np.uint64))


# the uploads' roundings that can overflow: (the array's dtype, what it is served as) -> magnitude floor
_SERVED_FLOORS = {(np.dtype(np.float32), BF16): _overflow_floor(np.dtype(np.float32), BF16),
                  (np.dtype(np.float64), BF16): _overflow_floor(np.dtype(np.float64), BF16),
                  (np.dtype(np.float64), np.dtype(np.float32)): _overflow_floor(np.dtype(np.float64),
                                                                               np.dtype(np.float32))}


def check_servable(a: Any, what: str, served: np.dtype) -> None:
    """WeightError naming the first finite value that rounds to Inf where the layer uploads it as
    `served` (bf16 matrices, float32 vectors): 3.4e38 is a float32 but no bf16."""
    dt = _float_dtype(a, what)
    floor = _SERVED_FLOORS.get((dt, np.dtype(served)))
    if floor is not None:
        _check_codes(a, dt, what, f"past {np.dtype(served).name}'s range: it would be served as Inf", floor)


def _check_codes(a: Any, dt: np.dtype, what: str, why: str, floor: Optional[int] = None) -> None:
    unsigned, signed, nonfinite = _NONFINITE_BITS[dt]
    floor = nonfinite if floor is None else floor
    bits = a.view(unsigned)
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    first = _first_hit(bits, _magnitude_hit(signed, floor, sign))
    if first is not None:
        b = _element(bits, first)
        value = np.array(b, dtype=unsigned).view(dt)
        shown = f"byte 0x{b:02X}" if dt == E4M3 else f"{float(value)!r} (bits 0x{b:0{2 * dt.itemsize}X})"
        raise WeightError(f"{what}{_at(first, _shape(a))} = {shown}: {why}; only finite weights can be "
                          "served (the checkpoint is corrupt or mis-read)")


def _check_scale_bits(bits: Any, bad, what: str, shown, accepted: str) -> None:
    """WeightError naming the first scale `bad(piece)` (a bool array) flags, and how many there are."""
    first, count = None, 0
    for off, piece in _pieces(bits, DEVICE_CHECK_CHUNK if on_device(bits) else CHECK_CHUNK):
        flags = bad(piece)
        n = int(flags.sum())
        if n and first is None:
            first = off + int(flags.argmax())
        count += n
    if count:
        shape = _shape(bits)
        raise WeightError(f"{what}{_at(first, shape)} = {shown(_element(bits, first))}: not a usable scale "
                          f"({count} such in {int(np.prod(shape, dtype=np.int64))}); expected {accepted} "
                          "(the checkpoint is corrupt or mis-read)")


def _f32_shown(b: int) -> str:
    return repr(float(np.array(b, dtype=np.uint32).view(np.float32)))


def check_positive_scales(a: Any, what: str) -> None:
    """float32 scales (fp8 scale_inv, nvfp4 scale_2) must be finite and > 0: a zero or negative
    one silently zeroes or flips its block, a non-finite one gives NaN outputs."""
    a = a if on_device(a) else np.asarray(a, dtype=np.float32)
    if np.dtype(a.dtype) != np.float32:
        raise WeightError(f"{what}: expected float32 scales, found dtype {a.dtype}")
    # as uint32 bits, bits - 1 (wrapping at 0) < 0x7F7FFFFF is exactly 0 < value <= float32 max
    _check_scale_bits(a.view(np.uint32), lambda p: (p - 1) >= 0x7F7FFFFF, what, _f32_shown,
                      "a finite scale > 0")


def check_e4m3_scales(a: Any, what: str) -> None:
    """nvfp4 group scales (e4m3 or uint8 bytes): no NaN (0x7F / 0xFF), none negative (-0 is a zero)."""
    _check_scale_bits(a.view(np.uint8), lambda p: (p == 0x7F) | (p > 0x80), what,
                      lambda b: f"byte 0x{b:02X}", "an e4m3 scale >= 0 that is not NaN (bytes 0x00-0x7E)")


def check_e8m0_scales(a: Any, what: str) -> None:
    """mxfp4 exponents (uint8 / e8m0 bytes): 255 is e8m0's NaN."""
    _check_scale_bits(a.view(np.uint8), lambda p: p == 255, what, lambda b: f"byte 0x{b:02X}",
                      "an e8m0 exponent byte 0..254 (255 is NaN)")


def check_values(t: Any, what: str) -> None:
    """Every value check of one weight: a plain float array or a quantized container."""
    if hasattr(t, "check_values"):
        t.check_values(what)
    else:
        check_finite(t, what)


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
        else:
            self.q = np.asarray(self.q)
            if self.q.dtype != E4M3:
                if self.q.dtype == np.uint8:
                    self.q = self.q.view(E4M3)
                else:
                    raise WeightError(f"Fp8BlockWeight.q: expected float8_e4m3fn, found {self.q.dtype}")
            self.scale_inv = np.asarray(self.scale_inv, dtype=np.float32)
        # shapes only (no copy): the device layer derives each expert's scale stride from them
        q_shape = _shape(self.q)
        if len(q_shape) < 2:
            raise WeightError(f"Fp8BlockWeight.q: expected [..., out, in], found shape {q_shape}")
        out, inn = q_shape[-2:]
        _expect_shape(self.scale_inv, q_shape[:-2] + (_ceil_div(out, FP8_BLOCK), _ceil_div(inn, FP8_BLOCK)),
                      "Fp8BlockWeight.scale_inv", f"q {q_shape}")

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
        """WeightError naming the first block scale that is not finite and > 0."""
        check_positive_scales(self.scale_inv, f"{name}.scale_inv")

    def check_values(self, name: str) -> None:
        """check_scales, and no e4m3 NaN code among the weights."""
        self.check_scales(name)
        check_e4m3_codes(self.q, f"{name}.q")

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
        else:
            self.packed = _bytes(self.packed, "Nvfp4Weight.packed")
            self.scale = np.asarray(self.scale)
            if self.scale.dtype == np.uint8:
                self.scale = self.scale.view(E4M3)
            if self.scale.dtype != E4M3:
                raise WeightError(f"Nvfp4Weight.scale: expected float8_e4m3fn, found {self.scale.dtype}")
        shape = _shape(self.packed)
        if len(shape) < 2:
            raise WeightError(f"Nvfp4Weight.packed: expected [..., out, in/2], found shape {shape}")
        lead = shape[:-2]
        self.scale_2 = _per_matrix(self.scale_2, lead, "Nvfp4Weight.scale_2")
        if self.input_scale is not None:
            self.input_scale = _per_matrix(self.input_scale, lead, "Nvfp4Weight.input_scale")
        inn = shape[-1] * 2
        if inn % NVFP4_GROUP:
            raise WeightError(f"Nvfp4Weight: in={inn} is not a multiple of {NVFP4_GROUP}")
        _expect_shape(self.scale, shape[:-1] + (inn // NVFP4_GROUP,), "Nvfp4Weight.scale", f"packed {shape}")

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
        """WeightError naming the first NaN or negative e4m3 group scale, or scale_2 not finite and > 0."""
        check_e4m3_scales(self.scale, f"{name}.weight_scale")
        check_positive_scales(self.scale_2, f"{name}.weight_scale_2")

    def check_values(self, name: str) -> None:
        """check_scales (every e2m1 code is a finite value)."""
        self.check_scales(name)

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
        else:
            self.blocks = _bytes(self.blocks, "Mxfp4Weight.blocks")
            sc = np.asarray(self.scales)
            if sc.dtype.name == "float8_e8m0fnu":  # the same bytes
                self.scales = sc.view(np.uint8)
            elif sc.dtype.itemsize == 1 and sc.dtype != np.uint8:
                # another 1-byte dtype's bits (int8, bool, e4m3 / e5m2) are no e8m0 exponents
                raise WeightError(f"Mxfp4Weight.scales: expected uint8 or float8_e8m0fnu e8m0 exponents, "
                                  f"found {sc.dtype}")
            else:  # biased exponents as integers of any width, each 0..255 (2^(e - 127) values are not)
                self.scales = _bytes(sc, "Mxfp4Weight.scales (e8m0 biased exponents)")
        shape = _shape(self.blocks)
        if len(shape) < 3 or shape[-1] != MXFP4_GROUP // 2:
            raise WeightError(f"Mxfp4Weight.blocks: expected [..., out, in/32, 16], found {shape}")
        _expect_shape(self.scales, shape[:-1], "Mxfp4Weight.scales")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.blocks.shape[:-2]) + (self.blocks.shape[-2] * MXFP4_GROUP,)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def __getitem__(self, idx) -> "Mxfp4Weight":
        return Mxfp4Weight(self.blocks[idx], self.scales[idx])

    def check_scales(self, name: str) -> None:
        """WeightError naming the first e8m0 scale 255 (the format's NaN)."""
        check_e8m0_scales(self.scales, f"{name}.scales")

    def check_values(self, name: str) -> None:
        """check_scales (every e2m1 code is a finite value)."""
        self.check_scales(name)

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
    raw = np.asarray(w)
    if raw.dtype.kind not in "biuf" and raw.dtype != BF16:  # complex (its imaginary part dropped), strings
        raise WeightError(f"{who}: expected real weights, found dtype {raw.dtype}")
    with np.errstate(over="ignore"):  # a float64 past float32's range: Inf, named below
        w = raw.astype(np.float32)
    if w.ndim < 2:
        raise WeightError(f"{who}: expected a [..., out, in] matrix (stack), found shape {w.shape}")
    bad = ~np.isfinite(w)  # also a float64 past float32's range: Inf once read
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise WeightError(f"{who}: weight{list(idx)} = {raw[idx]}: only finite weights can be quantized")
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
    if not isinstance(fmt, str):
        raise OptionError(f"quantize: format {fmt!r} is no format name; known: bf16, {', '.join(QUANTIZERS)}")
    if fmt == "bf16":
        w32 = _quantizer_input(w, "quantize(bf16)")
        check_servable(w32, "quantize(bf16)", BF16)  # 3.4e38 would round to Inf
        return w32.astype(BF16)
    if fmt not in QUANTIZERS:
        raise OptionError(f"quantize: unknown format {fmt!r}; known: bf16, {', '.join(QUANTIZERS)}")
    return QUANTIZERS[fmt](w)
