"""CPU tests of cupymoe.formats against FORMATS.md: e2m1 codes, nibble packing, and the
fp8-block / NVFP4 / MXFP4 quantizers and containers.

Evidence comes from three independent sources:
1. Tables and bytes written by hand from FORMATS.md (codes, packed bytes, e4m3 / e8m0
   scale bytes); the derivations are in the comments next to each literal.
2. Worst-case error bounds derived from the formats' grids (derivations in the comments
   of each bound helper), checked per element on random matrices (hypothesis drives the
   seeds, shapes and dynamic ranges; few examples so the file stays fast).
3. Structural properties: exact round trips of values already on a grid, and
   quantize(stack)[e] == quantize(stack[e]) bit for bit.

Error checks dequantize in float64, where the product code * scale is exact (a 4-bit e2m1
or e4m3 significand times a 24-bit float32 one fits in 53 bits), so the only rounding
left is the quantizer's own and the bounds need no float32 slop term.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cupymoe import formats
from cupymoe.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

# Few examples, no deadline (the first call of a numpy path can take tens of ms).
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random_matrix(seed: int, shape: tuple[int, ...], log2_scale: int, spread: int) -> np.ndarray:
    """float32 normals times 2^log2_scale, each element further scaled by 2^-u with
    u uniform in [0, spread]: a wide dynamic range inside one block/group, so small
    elements land on the e4m3 subnormals / the low end of e2m1 as well as the top."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp2(log2_scale - rng.uniform(0, spread, size=shape))
    return w.astype(np.float32)


# ==================================================================================
# e2m1 codes
# ==================================================================================

# FORMATS.md: `0:0, 1:0.5, 2:1, 3:1.5, 4:2, 5:3, 6:4, 7:6`, codes 8-15 are the negatives.
E2M1_TABLE = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0,
              8: -0.0, 9: -0.5, 10: -1.0, 11: -1.5, 12: -2.0, 13: -3.0, 14: -4.0, 15: -6.0}


@pytest.mark.parametrize("code", range(16))
def test_e2m1_decode_matches_formats_md(code):
    got = formats.e2m1_decode(np.array([code]))
    assert got.dtype == np.float32
    assert got[0] == E2M1_TABLE[code]
    # code 8 is negative zero: the sign bit must survive the decode
    assert math.copysign(1.0, float(got[0])) == (-1.0 if code >= 8 else 1.0)


def test_e2m1_decode_uses_only_low_nibble():
    # e2m1_decode masks with 0xF: 0x17 -> 7 -> 6.0, 0xF9 -> 9 -> -0.5
    assert list(formats.e2m1_decode(np.array([0x17, 0xF9]))) == [6.0, -0.5]


@pytest.mark.parametrize("code", [c for c in range(16) if c != 8])
def test_e2m1_encode_inverts_decode(code):
    assert formats.e2m1_encode(np.array([E2M1_TABLE[code]]))[0] == code


def test_e2m1_encode_negative_zero():
    # -0.0 keeps its sign bit (code 8); +0.0 is code 0. Both decode to a zero.
    assert list(formats.e2m1_encode(np.array([0.0, -0.0]))) == [0, 8]


# Midpoints between neighbouring grid values. Round-to-nearest-even picks the neighbour
# whose code is even (the e2m1 mantissa bit is the code's lowest bit):
#   0.25 between 0 (code 0) and 0.5 (code 1)  -> 0    (code 0)
#   0.75 between 0.5 (code 1) and 1 (code 2)  -> 1    (code 2)
#   1.25 between 1 (code 2) and 1.5 (code 3)  -> 1    (code 2)
#   1.75 between 1.5 (code 3) and 2 (code 4)  -> 2    (code 4)
#   2.5  between 2 (code 4) and 3 (code 5)    -> 2    (code 4)
#   3.5  between 3 (code 5) and 4 (code 6)    -> 4    (code 6)
#   5    between 4 (code 6) and 6 (code 7)    -> 4    (code 6)
# negatives mirror them with code + 8; -0.25 rounds to -0 (code 8).
MIDPOINTS = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
             (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14)]


@pytest.mark.parametrize("value,code", MIDPOINTS)
def test_e2m1_encode_ties_to_even(value, code):
    assert formats.e2m1_encode(np.array([value], np.float32))[0] == code


@pytest.mark.parametrize("value,code", [
    (0.2, 0), (0.3, 1), (0.8, 2), (2.6, 5), (4.9, 6), (5.1, 7),  # nearest, not a tie
    (6.5, 7), (7.0, 7), (100.0, 7), (np.inf, 7),  # saturate at +6 (code 7), never NaN
    (-6.5, 15), (-1e30, 15), (-np.inf, 15),  # saturate at -6 (code 15)
])
def test_e2m1_encode_nearest_and_saturation(value, code):
    assert formats.e2m1_encode(np.array([value], np.float32))[0] == code


# ==================================================================================
# nibble packing: element 2j in the low nibble
# ==================================================================================

@pytest.mark.parametrize("codes,packed", [
    ([1, 2], [0x21]),  # low nibble = element 0 = 1, high = element 1 = 2
    ([2, 1], [0x12]),
    ([15, 0], [0x0F]),
    ([0, 15], [0xF0]),
    ([7, 9, 3, 12], [0x97, 0xC3]),
])
def test_pack_nibbles_hand_bytes(codes, packed):
    got = formats.pack_nibbles(np.array(codes, np.uint8))
    assert got.dtype == np.uint8
    assert list(got) == packed
    assert list(formats.unpack_nibbles(np.array(packed, np.uint8))) == codes


def test_pack_unpack_round_trip_with_leading_axes():
    codes = np.random.default_rng(0).integers(0, 16, size=(3, 5, 8), dtype=np.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (3, 5, 4)
    # element-wise restatement of the layout
    assert np.array_equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert np.array_equal(formats.unpack_nibbles(packed), codes)
    every_byte = np.arange(256, dtype=np.uint8)
    assert np.array_equal(formats.pack_nibbles(formats.unpack_nibbles(every_byte)), every_byte)


def test_pack_nibbles_odd_length_refused():
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        formats.pack_nibbles(np.zeros((2, 3), np.uint8))


# ==================================================================================
# fp8 block (DeepSeek-V3)
# ==================================================================================

def fp8_error_bound(w: np.ndarray, s_full: np.ndarray) -> np.ndarray:
    """Per-element bound on |w - q*s| for one block scale s = amax / 448.

    Derivation. v = fl32(w / s) = (w/s)(1 + d), |d| <= 2^-24; |v| <= 448 (up to a float32
    ulp that e4m3 rounds back to 448). e4m3 has 3 stored mantissa bits:
    - normal range |v| >= 2^-6: round-to-nearest moves v by at most half an ulp,
      2^(floor(log2|v|) - 4) <= 2^-4 |v| (in fact <= |v|/17, the worst case being
      v = 2^e (1 + 2^-4));
    - subnormal range |v| < 2^-6: the grid spacing is 2^-9, so |q - v| <= 2^-10.
    Hence |q - v| <= 2^-4 |v| + 2^-10 and, multiplying by s,
        |w - q s| <= |w - v s| + |v - q| s <= 2^-24 |w| + |w|/17 (1 + 2^-24) + 2^-10 s
                  <= 2^-4 |w| + 2^-10 s
    because 2^-4 - 1/17 = 1/272 absorbs the 2^-24 terms.
    """
    return 2.0 ** -4 * np.abs(w.astype(np.float64)) + 2.0 ** -10 * s_full


def _expand_blocks(scale_inv: np.ndarray, out: int, inn: int) -> np.ndarray:
    s = np.repeat(np.repeat(scale_inv.astype(np.float64), 128, axis=-2), 128, axis=-1)
    return s[..., :out, :inn]


def _fp8_expected_scale(w: np.ndarray) -> np.ndarray:
    """amax / 448 per 128x128 block (float32 division), 1.0 for an all-zero block;
    computed with plain loops, independently of formats._blocks_2d."""
    out, inn = w.shape[-2:]
    lead = w.shape[:-2]
    so, si = -(-out // 128), -(-inn // 128)
    s = np.ones(lead + (so, si), np.float32)
    for idx in np.ndindex(*lead, so, si):
        *e, bo, bi = idx
        blk = w[tuple(e) + (slice(bo * 128, bo * 128 + 128), slice(bi * 128, bi * 128 + 128))]
        amax = np.float32(np.abs(blk).max())
        if amax > 0:
            s[idx] = amax / np.float32(448.0)
    return s


def test_fp8_partial_blocks_shape_and_scales():
    # out=130, in=200: ceil(130/128) = 2 row blocks, ceil(200/128) = 2 column blocks; the
    # last blocks are 2 x 128, 128 x 72 and 2 x 72 elements.
    w = _random_matrix(1, (130, 200), 0, 0)
    w[129, 199] = 7.0  # the 2 x 72 corner block's amax: its scale must be 7/448 exactly
    qw = formats.quantize_fp8_block(w)
    assert isinstance(qw, Fp8BlockWeight)
    assert qw.q.dtype == E4M3 and qw.q.shape == (130, 200)
    assert qw.scale_inv.dtype == np.float32 and qw.scale_inv.shape == (2, 2)
    assert qw.shape == (130, 200)
    assert qw.nbytes == 130 * 200 + 4 * 4
    assert np.array_equal(qw.scale_inv, _fp8_expected_scale(w))
    assert qw.scale_inv[1, 1] == np.float32(7.0) / np.float32(448.0)
    # the block's amax element sits exactly at e4m3's max (7 / (7/448) = 448 up to one
    # float32 ulp, which e4m3 rounds to 448)
    assert float(qw.q[129, 199]) == 448.0
    dq = qw.dequantize(np.float64)
    assert np.all(np.abs(w - dq) <= fp8_error_bound(w, _expand_blocks(qw.scale_inv, 130, 200)))


def test_fp8_all_zero_block_gets_unit_scale():
    w = np.zeros((130, 130), np.float32)
    w[:128, :128] = 7.0
    qw = formats.quantize_fp8_block(w)
    # scale 7/448 = 2^-6 (exact) where amax = 7; 1.0 (not 0, which would divide by
    # zero) for the three all-zero blocks
    assert np.array_equal(qw.scale_inv, np.array([[2.0 ** -6, 1], [1, 1]], np.float32))
    # 7 / 2^-6 = 448 exactly and 448 * 2^-6 = 7: the round trip is exact
    assert np.array_equal(qw.dequantize(np.float64), w)


@given(seed=st.integers(0, 2 ** 32 - 1), out=st.integers(1, 300), inn=st.integers(1, 300),
       log2_scale=st.integers(-30, 30), spread=st.integers(0, 24))
@PROPERTY
def test_fp8_error_bound_property(seed, out, inn, log2_scale, spread):
    w = _random_matrix(seed, (out, inn), log2_scale, spread)
    qw = formats.quantize_fp8_block(w)
    assert qw.scale_inv.shape == (-(-out // 128), -(-inn // 128))
    assert np.array_equal(qw.scale_inv, _fp8_expected_scale(w))
    dq = qw.dequantize(np.float64)
    bound = fp8_error_bound(w, _expand_blocks(qw.scale_inv, out, inn))
    err = np.abs(w.astype(np.float64) - dq)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"


def test_fp8_leading_expert_axes_and_indexing():
    w = _random_matrix(2, (3, 130, 200), 0, 8)
    w[1] *= 1000.0  # experts of very different magnitudes keep separate scales
    qw = formats.quantize_fp8_block(w)
    assert qw.shape == (3, 130, 200) and qw.scale_inv.shape == (3, 2, 2)
    assert np.array_equal(qw.scale_inv, _fp8_expected_scale(w))
    dq = qw.dequantize(np.float64)
    for e in range(3):
        one = formats.quantize_fp8_block(w[e])
        sub = qw[e]
        assert isinstance(sub, Fp8BlockWeight) and sub.shape == (130, 200)
        # stacking changes nothing: bit-identical to quantizing the expert alone
        assert np.array_equal(sub.q.view(np.uint8), one.q.view(np.uint8))
        assert np.array_equal(sub.scale_inv, one.scale_inv)
        assert np.array_equal(sub.dequantize(np.float64), dq[e])


@given(seed=st.integers(0, 2 ** 32 - 1), log2_s=st.integers(-60, 60), odd=st.integers(0, 2 ** 19 - 1))
@PROPERTY
def test_fp8_on_grid_values_round_trip_exactly(seed, log2_s, odd):
    # s = m * 2^k with m odd < 2^20: every q * s (q has <= 4 significant bits) has <= 24
    # significant bits, so w = q * s is exact in float32. Each block holds one +-448, so
    # its amax is 448 s and the quantizer's scale fl(448 s / 448) = s exactly; then
    # w / s = q exactly and q rounds to itself: the round trip must be exact.
    rng = np.random.default_rng(seed)
    s = np.float32(math.ldexp(2 * odd + 1, log2_s - 20))
    finite = np.array([b for b in range(256) if np.isfinite(np.uint8(b).view(E4M3).astype(np.float32))],
                      np.uint8)
    q = rng.choice(finite, size=(130, 140)).view(E4M3)
    q[0, 0] = q[128, 0] = q[0, 128] = q[128, 128] = np.float32(448.0)  # one per block
    q[129, 129] = np.float32(-448.0)
    w = (q.astype(np.float64) * np.float64(s)).astype(np.float32)
    assert np.array_equal(w.astype(np.float64), q.astype(np.float64) * np.float64(s))  # exact
    qw = formats.quantize_fp8_block(w)
    assert np.all(qw.scale_inv == s)
    assert np.array_equal(qw.dequantize(np.float32), w)
    # codes equal as values (+0 and -0 may differ in sign bit only where w is zero)
    assert np.array_equal(qw.q.astype(np.float32), q.astype(np.float32))


def test_fp8_dequantize_float64_is_an_exact_product():
    # q = [[1.5, -2], [0.0625, 448]] (all e4m3 values), one block scale
    # s = float32(0.1) = 0.100000001490116119384765625 (13421773 * 2^-27).
    # q * s needs <= 24 + 2 significant bits: exact in float64, so the expected values
    # are exactly 1.5 s, -2 s, s / 16 and 448 s written out.
    s = np.float32(0.1)
    assert float(s) == 13421773 * 2.0 ** -27
    qw = Fp8BlockWeight(np.array([[1.5, -2.0], [0.0625, 448.0]], np.float32).astype(E4M3),
                        np.array([[s]], np.float32))
    expected = np.array([[1.5 * 13421773 * 2.0 ** -27, -2 * 13421773 * 2.0 ** -27],
                         [13421773 * 2.0 ** -31, 448 * 13421773 * 2.0 ** -27]])
    got = qw.dequantize(np.float64)
    assert got.dtype == np.float64
    assert np.array_equal(got, expected)
    # the float32 result is the float64 one rounded once
    assert np.array_equal(qw.dequantize(np.float32), expected.astype(np.float32))
    assert np.array_equal(formats.dequantize(qw), expected)  # module-level default float64


def test_fp8_partial_block_dequantize_uses_its_blocks_scale():
    # W[i, j] = q[i, j] * s[i // 128, j // 128]: with q = 1 everywhere, each element
    # must show its block's scale.
    s = np.array([[1.0, 2.0], [4.0, 8.0]], np.float32)
    qw = Fp8BlockWeight(np.ones((130, 200), np.float32).astype(E4M3), s)
    dq = qw.dequantize(np.float64)
    assert dq[0, 0] == 1 and dq[127, 127] == 1
    assert dq[0, 128] == 2 and dq[127, 199] == 2
    assert dq[128, 0] == 4 and dq[129, 127] == 4
    assert dq[128, 128] == 8 and dq[129, 199] == 8


def test_fp8_container_validation():
    q = np.zeros((130, 200), np.float32).astype(E4M3)
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\).*found \(1, 2\)"):
        Fp8BlockWeight(q, np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="float8_e4m3fn.*float32"):
        Fp8BlockWeight(np.zeros((4, 4), np.float32), np.ones((1, 1), np.float32))
    # uint8 bytes are taken as e4m3 bit patterns: 0x38 = 0 0111 000 = 2^(7-7) = 1.0
    raw = Fp8BlockWeight(np.full((2, 2), 0x38, np.uint8), np.full((1, 1), 3.0, np.float32))
    assert raw.q.dtype == E4M3
    assert np.array_equal(raw.dequantize(np.float64), np.full((2, 2), 3.0))


# ==================================================================================
# NVFP4 (ModelOpt)
# ==================================================================================

def nvfp4_error_bound(qw: Nvfp4Weight) -> np.ndarray:
    """Per-element bound on |w - dq| for NVFP4, from the container's own scales.

    s_g = float(e4m3 scale) * scale_2 is the group's effective scale, v = w / s_g the value
    the e2m1 code stands for. Two cases:
    - |v| <= 6: rounding to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} moves v by at most
      half the widest spacing, (6 - 4) / 2 = 1, so |w - dq| <= s_g.
    - |v| > 6: saturation to 6. It happens only because the e4m3 scale was rounded down
      from s_true = gmax / (6 scale_2): |v| <= gmax / s_g = 6 s_true / s. With a normal
      e4m3 scale |s - s_true| <= 2^-4 s_true, so the overshoot (|v| - 6) s_g
      = 6 scale_2 (s_true - s) <= 6 * 2^-4 s_g / (1 - 2^-4) < 0.4 s_g; with an e4m3
      subnormal scale (s_true < 2^-6, grid 2^-9) s_true - s <= 2^-10, overshoot
      <= 6 * 2^-10 scale_2. That term also covers a scale that rounds to 0 (then dq = 0
      and |w| <= gmax = 6 s_true scale_2 < 6 * 2^-10 scale_2).
    Together: |w - dq| <= (1 + 6 * 2^-4) s_g + 6 * 2^-10 scale_2. The float32 rounding of
    w / (s scale_2) inside the quantizer (~2^-23 relative) is absorbed by the
    1.375 vs 1 slack.
    """
    s = np.repeat(qw.scale.astype(np.float64), 16, axis=-1)
    s2 = qw.scale_2.astype(np.float64)[..., None, None]
    return (1 + 6 * 2.0 ** -4) * s * s2 + 6 * 2.0 ** -10 * s2


def test_nvfp4_hand_made_example():
    # One row, in = 48: three groups of 16.
    # group 0: the e2m1 grid times 448; amax over the matrix = 6 * 448 = 2688, so
    #   scale_2 = 2688 / (448 * 6) = 1.0, s_true = 2688 / 6 / 1 = 448 = e4m3 max:
    #   448 = 1.75 * 2^8 -> e4m3 exponent field 8 + 7 = 15 (1111), mantissa 110 -> 0x7E.
    #   v = w / 448 is the grid value itself, so the codes are exact:
    #   codes [7, 1, 2, 3, 4, 5, 6, 0, 9, 10, 11, 12, 13, 14, 15, 15]
    #   bytes (low nibble = even element): 0x17 0x32 0x54 0x06 0xA9 0xCB 0xED 0xFF
    # group 1: [12, 5, -1, 0.5, 0 ...]: gmax 12 -> s_true = 12 / 6 = 2 -> e4m3 2.0:
    #   exponent field 1 + 7 = 8 (1000), mantissa 000 -> 0x40. v = w / 2 =
    #   [6, 2.5, -0.5, 0.25, 0...] -> codes [7, 4 (tie to even), 9, 0 (tie to even), 0...]
    #   bytes 0x47 0x09 0x00 ... ; dequantized [12, 4, -1, 0, 0...]
    # group 2: [13.8, -4.5, 0 ...]: gmax 13.8 -> s_true = 2.3 -> e4m3 grid in [2, 4) has
    #   spacing 0.25 -> 2.25 = 1.125 * 2 -> exponent 1000, mantissa 001 -> 0x41.
    #   v = [13.8 / 2.25 = 6.13 -> saturates to 6 (code 7), -4.5 / 2.25 = -2 (code 12)]
    #   bytes 0xC7 0x00 ... ; dequantized [13.5, -4.5, 0...] (error 0.3 <= 1.375 * 2.25).
    g0 = np.array([6, .5, 1, 1.5, 2, 3, 4, 0, -.5, -1, -1.5, -2, -3, -4, -6, -6]) * 448
    g1 = np.array([12, 5, -1, 0.5] + [0] * 12)
    g2 = np.array([13.8, -4.5] + [0] * 14)
    w = np.concatenate([g0, g1, g2]).astype(np.float32)[None, :]
    qw = formats.quantize_nvfp4(w)
    assert isinstance(qw, Nvfp4Weight) and qw.shape == (1, 48)
    assert qw.packed.dtype == np.uint8 and qw.packed.shape == (1, 24)
    assert qw.scale.dtype == E4M3 and qw.scale.shape == (1, 3)
    assert qw.scale_2.dtype == np.float32 and qw.scale_2.shape == () and qw.scale_2 == 1.0
    assert list(qw.packed[0]) == [0x17, 0x32, 0x54, 0x06, 0xA9, 0xCB, 0xED, 0xFF,
                                  0x47, 0x09, 0, 0, 0, 0, 0, 0,
                                  0xC7, 0, 0, 0, 0, 0, 0, 0]
    assert list(qw.scale.view(np.uint8)[0]) == [0x7E, 0x40, 0x41]
    expected = np.concatenate([g0, [12, 4, -1, 0] + [0] * 12, [13.5, -4.5] + [0] * 14])
    assert np.array_equal(qw.dequantize(np.float64)[0], expected)
    # the same container built from the hand bytes decodes identically
    hand = Nvfp4Weight(qw.packed.copy(), np.array([[0x7E, 0x40, 0x41]], np.uint8), np.float32(1.0))
    assert np.array_equal(hand.dequantize(np.float64)[0], expected)
    assert np.all(np.abs(w - qw.dequantize(np.float64)) <= nvfp4_error_bound(qw))


def test_nvfp4_subnormal_group_scales_need_the_floor_term():
    # scale_2 = 1 (group 0 holds 2688 = 448 * 6). e4m3 subnormals are multiples of 2^-9.
    # group 1: gmax = 8.4 * 2^-9 -> s_true = 1.4 * 2^-9 rounds DOWN to 2^-9 (byte 0x01);
    #   v = 8.4 saturates to 6 (code 7): dq = 6 * 2^-9, error 2.4 * 2^-9. That exceeds
    #   (1 + 6 * 2^-4) s_g = 1.375 * 2^-9: the e4m3 subnormal floor term 6 * 2^-10 of
    #   nvfp4_error_bound (3 * 2^-9 here) is what covers it.
    # group 2: gmax = 2^-12 -> s_true = 2^-12 / 6 < 2^-10 (half the smallest subnormal)
    #   rounds to 0 (byte 0x00): the whole group dequantizes to 0, error 2^-12 <= 6 * 2^-10.
    w = np.zeros((1, 48), np.float32)
    w[0, 0] = 2688.0
    w[0, 16] = 8.4 * 2.0 ** -9
    w[0, 32] = 2.0 ** -12
    qw = formats.quantize_nvfp4(w)
    assert qw.scale_2 == 1.0
    assert list(qw.scale.view(np.uint8)[0]) == [0x7E, 0x01, 0x00]
    dq = qw.dequantize(np.float64)[0]
    assert dq[0] == 2688.0 and dq[16] == 6 * 2.0 ** -9 and dq[32] == 0.0
    err = np.abs(w[0] - dq)
    assert err[16] > (1 + 6 * 2.0 ** -4) * 2.0 ** -9  # the plain bound alone is not enough
    assert np.all(err <= nvfp4_error_bound(qw)[0])


def test_nvfp4_global_scale_is_amax_over_2688():
    w = _random_matrix(3, (4, 5, 32), 3, 4)
    qw = formats.quantize_nvfp4(w)
    assert qw.scale_2.shape == (4,)
    for e in range(4):
        amax = np.float32(np.abs(w[e]).max())
        assert qw.scale_2[e] == amax / np.float32(448 * 6)
        # the largest element's group gets scale amax / 6 / scale_2 = 448 (e4m3 max, up to
        # float32 rounding that e4m3 absorbs) and the element itself code +-6 (7 or 15)
        i, j = np.unravel_index(np.argmax(np.abs(w[e])), w[e].shape)
        assert float(qw.scale[e, i, j // 16]) == 448.0
        assert formats.unpack_nibbles(qw.packed[e])[i, j] == (7 if w[e, i, j] > 0 else 15)
    # an all-zero matrix gets scale_2 = 1 (not 0, which would divide by zero)
    assert np.array_equal(formats.quantize_nvfp4(np.zeros((2, 16), np.float32)).scale_2, np.float32(1.0))


@given(seed=st.integers(0, 2 ** 32 - 1), out=st.integers(1, 40), groups=st.integers(1, 12),
       log2_scale=st.integers(-30, 30), spread=st.integers(0, 24))
@PROPERTY
def test_nvfp4_error_bound_property(seed, out, groups, log2_scale, spread):
    w = _random_matrix(seed, (out, 16 * groups), log2_scale, spread)
    qw = formats.quantize_nvfp4(w)
    assert qw.packed.shape == (out, 8 * groups) and qw.scale.shape == (out, groups)
    assert qw.scale_2 == np.float32(np.abs(w).max()) / np.float32(2688)
    # the group scales are the e4m3 rounding of gmax / 6 / scale_2 (never above 448)
    assert np.all(qw.scale.astype(np.float32) <= 448)
    err = np.abs(w.astype(np.float64) - qw.dequantize(np.float64))
    bound = nvfp4_error_bound(qw)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"


def test_nvfp4_leading_axes_and_indexing():
    w = _random_matrix(4, (3, 6, 64), 0, 6)
    w[2] *= 1e-3
    qw = formats.quantize_nvfp4(w)
    dq = qw.dequantize(np.float64)
    for e in range(3):
        one, sub = formats.quantize_nvfp4(w[e]), qw[e]
        assert isinstance(sub, Nvfp4Weight) and sub.shape == (6, 64)
        assert np.array_equal(sub.packed, one.packed)
        assert np.array_equal(sub.scale.view(np.uint8), one.scale.view(np.uint8))
        assert sub.scale_2 == one.scale_2
        assert np.array_equal(sub.dequantize(np.float64), dq[e])


def test_nvfp4_validation_names_shapes():
    packed = np.zeros((2, 16), np.uint8)  # in = 32 -> scale must be [2, 2]
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\).*\(2, 16\).*found \(2, 1\)"):
        Nvfp4Weight(packed, np.zeros((2, 1), np.uint8), np.float32(1))
    with pytest.raises(ValueError, match="in=8 is not a multiple of 16"):
        Nvfp4Weight(np.zeros((2, 4), np.uint8), np.zeros((2, 0), np.uint8), np.float32(1))
    with pytest.raises(ValueError, match="float8_e4m3fn.*float32"):
        Nvfp4Weight(packed, np.zeros((2, 2), np.float32), np.float32(1))
    with pytest.raises(ValueError, match="in=24 is not a multiple of 16"):
        formats.quantize_nvfp4(np.zeros((2, 24), np.float32))


# ==================================================================================
# MXFP4 (OCP MX, gpt-oss)
# ==================================================================================

def _floor_log2(x: np.ndarray) -> np.ndarray:
    """Exact floor(log2(x)) for x > 0, from the binary exponent (frexp: x = m 2^p,
    m in [0.5, 1) -> floor(log2 x) = p - 1): no floating-point log involved."""
    return np.frexp(x.astype(np.float64))[1] - 1


def mxfp4_error_bound(w: np.ndarray, qw: Mxfp4Weight) -> np.ndarray:
    """Per-element bound on |w - dq| with e = scale - 127, v = w / 2^e (exact: a power of 2).

    With e = floor(log2 gmax) - 2, gmax / 2^e is in [4, 8): every |v| < 8.
    - |v| in [6, 8) saturates to 6: error < 2 * 2^e = 2^(e+1);
    - |v| in [4, 6]: grid spacing 2 -> half-spacing 1: error <= 2^e;
    - |v| in [2, 4): spacing 1 -> error <= 2^(e-1);
    - |v| < 2: spacing 0.5 -> error <= 2^(e-2).
    """
    e = np.repeat(qw.scales.astype(np.int64) - 127, 32, axis=-1).reshape(w.shape)
    u = np.exp2(e.astype(np.float64))
    a = np.abs(w.astype(np.float64)) / u
    return np.where(a < 2, 0.25, np.where(a < 4, 0.5, np.where(a <= 6, 1.0, 2.0))) * u


def test_mxfp4_hand_packed_blocks():
    # Block 0 (32 values): gmax = 7.5 -> floor(log2 7.5) = 2 -> e = 0 -> scale byte 127.
    # v = w; codes and the rounding behind each:
    #   0->0  .5->1  1->2  1.5->3  2->4  3->5  4->6  6->7  -.5->9  -1->10  -1.5->11  -2->12
    #   -3->13  -4->14  -6->15  .25->0 (tie, even)  .75->2 (tie)  2.5->4 (tie)  5->6 (tie)
    #   7->7 (saturates)  -7.5->15 (saturates)  3.5->6 (tie)  1.25->2 (tie)  1.75->4 (tie)
    #   then 8 zeros.
    # bytes, element 2j low: (0,1)0x10 (2,3)0x32 (4,5)0x54 (6,7)0x76 (9,10)0xA9 (11,12)0xCB
    #   (13,14)0xED (15,0)0x0F (2,4)0x42 (6,7)0x76 (15,6)0x6F (2,4)0x42 then 4 x 0x00.
    b0 = [0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, .25,
          .75, 2.5, 5, 7, -7.5, 3.5, 1.25, 1.75] + [0] * 8
    d0 = [0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 0,
          1, 2, 4, 6, -6, 4, 1, 2] + [0] * 8
    # Block 1: [0.75, -0.0625, 0.1, 0...]: gmax 0.75 -> floor(log2 .75) = -1 -> e = -3
    #   -> scale byte 124. v = 8 w = [6, -0.5, 0.8] -> codes [7, 9, 2] (0.8 is nearer 1
    #   than 0.5) -> bytes (7,9)0x97 (2,0)0x02; dequantized [0.75, -0.0625, 0.125].
    b1 = [0.75, -0.0625, 0.1] + [0] * 29
    d1 = [0.75, -0.0625, 0.125] + [0] * 29
    w = np.array([b0 + b1], np.float32)
    qw = formats.quantize_mxfp4(w)
    assert isinstance(qw, Mxfp4Weight) and qw.shape == (1, 64)
    assert qw.blocks.shape == (1, 2, 16) and qw.scales.shape == (1, 2)
    assert list(qw.blocks[0, 0]) == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F,
                                     0x42, 0x76, 0x6F, 0x42, 0, 0, 0, 0]
    assert list(qw.blocks[0, 1]) == [0x97, 0x02] + [0] * 14
    assert list(qw.scales[0]) == [127, 124]
    assert np.array_equal(qw.dequantize(np.float64)[0], np.array(d0 + d1))
    # a container built from the hand bytes (scales as e8m0, as safetensors gives them)
    hand = Mxfp4Weight(qw.blocks.copy(), np.array([[127, 124]], np.uint8).view(ml_dtypes.float8_e8m0fnu))
    assert hand.scales.dtype == np.uint8
    assert np.array_equal(hand.dequantize(np.float64)[0], np.array(d0 + d1))
    assert np.all(np.abs(w - qw.dequantize(np.float64)) <= mxfp4_error_bound(w, qw))


@given(seed=st.integers(0, 2 ** 32 - 1), out=st.integers(1, 20), groups=st.integers(1, 8),
       log2_scale=st.integers(-100, 100), spread=st.integers(0, 24))
@PROPERTY
def test_mxfp4_scale_and_error_bound_property(seed, out, groups, log2_scale, spread):
    # Random normals hit the float32 neighbourhood just below a power of two (see
    # test_mxfp4_exponent_just_below_a_power_of_two) with probability ~2^-20 per group.
    w = _random_matrix(seed, (1, out, 32 * groups), log2_scale, spread)
    qw = formats.quantize_mxfp4(w)
    assert qw.blocks.shape == (1, out, groups, 16) and qw.scales.shape == (1, out, groups)
    gmax = np.abs(w.reshape(1, out, groups, 32)).max(axis=-1)
    # 2^(scale - 127) = 2^(floor(log2 gmax) - 2) for every non-zero group (|log2_scale| <=
    # 100 keeps the exponent far inside e8m0's range, so no clipping)
    assert np.array_equal(qw.scales.astype(np.int64) - 127, _floor_log2(gmax) - 2)
    err = np.abs(w.astype(np.float64) - qw.dequantize(np.float64))
    bound = mxfp4_error_bound(w, qw)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"
    # the two headline bounds of the format: 2^(e+1) everywhere, half-spacing below 4 * 2^e
    u = np.exp2(np.repeat(qw.scales.astype(np.float64) - 127, 32, axis=-1).reshape(w.shape))
    assert np.all(err <= 2 * u)
    small = np.abs(w) < 4 * u
    assert np.all(err[small] <= 0.5 * u[small])


def test_mxfp4_exponent_just_below_a_power_of_two():
    # gmax = nextafter(8, 0) = 8 (1 - 2^-24): floor(log2 gmax) = 2 exactly, so OCP MX's
    # shared exponent is 2 - 2 = 0 (scale byte 127) and gmax / 2^0 ~ 8 saturates to 6.
    # float32 log2(gmax) = 3 - 1.7e-7 rounds to 3.0 (ulp there is 2.4e-7), giving 128.
    w = np.zeros((1, 32), np.float32)
    w[0, 0] = np.nextafter(np.float32(8), np.float32(0))
    w[0, 1] = 0.75  # with the spec's scale 2^0 this is 0.75 -> code 2 (1.0); with 2^1 it is 0
    assert _floor_log2(np.abs(w).max()) == 2
    assert formats.quantize_mxfp4(w).scales[0, 0] == 127


def test_mxfp4_zero_and_tiny_groups():
    w = np.zeros((2, 64), np.float32)
    w[1, 32] = 2.0 ** -140  # float32 subnormal: floor(log2) - 2 = -142, clipped to e8m0's -127
    qw = formats.quantize_mxfp4(w)
    assert qw.scales[0, 0] == 0 and qw.scales[1, 1] == 0  # 2^-127: the smallest e8m0 scale
    # v = 2^-140 / 2^-127 = 2^-13 rounds to 0: error 2^-140 <= 2^-128 (half-spacing bound)
    assert np.array_equal(qw.dequantize(np.float64), np.zeros((2, 64)))


def test_mxfp4_leading_axes_and_indexing():
    w = _random_matrix(5, (3, 4, 64), 0, 10)
    qw = formats.quantize_mxfp4(w)
    assert qw.shape == (3, 4, 64) and qw.blocks.shape == (3, 4, 2, 16)
    dq = qw.dequantize(np.float64)
    for e in range(3):
        one, sub = formats.quantize_mxfp4(w[e]), qw[e]
        assert isinstance(sub, Mxfp4Weight) and sub.shape == (4, 64)
        assert np.array_equal(sub.blocks, one.blocks) and np.array_equal(sub.scales, one.scales)
        assert np.array_equal(sub.dequantize(np.float64), dq[e])


def test_mxfp4_validation_names_shapes():
    with pytest.raises(ValueError, match=r"\[\.\.\., out, in/32, 16\].*\(2, 1, 15\)"):
        Mxfp4Weight(np.zeros((2, 1, 15), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match=r"\(2, 16\)"):
        Mxfp4Weight(np.zeros((2, 16), np.uint8), np.zeros((2,), np.uint8))
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\), found \(2, 2\)"):
        Mxfp4Weight(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 2), np.uint8))
    with pytest.raises(ValueError, match="in=48 is not a multiple of 32"):
        formats.quantize_mxfp4(np.zeros((2, 48), np.float32))


def test_containers_refuse_arrays_a_byte_cast_would_change():
    """Codes and exponents held in wider arrays are taken when every value is a byte; a cast of
    anything else would wrap (256 -> 0, -1 -> 255) or truncate (2^(e - 127) as float32 -> 0),
    silently giving other weights, so it is refused, naming the container, the value and where."""
    blocks = np.zeros((2, 1, 16), np.uint8)
    ok = Mxfp4Weight(blocks, np.array([[127], [130]], np.int32))
    assert ok.scales.dtype == np.uint8 and ok.scales.tolist() == [[127], [130]]
    with pytest.raises(ValueError, match=r"Mxfp4Weight.scales \(e8m0 biased exponents\): expected byte values "
                                         r"0\.\.255, found 383 at \(1, 0\)"):
        Mxfp4Weight(blocks, np.array([[127], [383]], np.int32))
    with pytest.raises(ValueError, match=r"Mxfp4Weight.scales \(e8m0 biased exponents\): expected uint8 bytes, "
                                         r"found dtype float32"):
        Mxfp4Weight(blocks, np.array([[2.0 ** -1], [2.0 ** 3]], np.float32))
    with pytest.raises(ValueError, match="Mxfp4Weight.blocks: expected uint8 bytes, found dtype float64"):
        Mxfp4Weight(blocks.astype(np.float64) + 0.7, np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match=r"Nvfp4Weight.packed: expected byte values 0\.\.255, found -1 at \(0, 0\)"):
        Nvfp4Weight(np.full((2, 8), -1, np.int16), np.zeros((2, 1), np.uint8), np.float32(1))
    with pytest.raises(ValueError, match=r"Nvfp4Weight.scale_2: expected one value per matrix, shape \(3,\) "
                                         r"\(or a scalar\), found shape \(2,\)"):
        Nvfp4Weight(np.zeros((3, 2, 8), np.uint8), np.zeros((3, 2, 1), np.uint8), np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"Fp8BlockWeight.q: expected \[\.\.\., out, in\], found shape \(4,\)"):
        Fp8BlockWeight(np.zeros(4, np.uint8), np.ones((1, 1), np.float32))


# ==================================================================================
# dispatch and format names
# ==================================================================================

def test_quantize_dispatch():
    w = _random_matrix(6, (2, 3, 64), 0, 4)
    b = formats.quantize(w, "bf16")
    assert isinstance(b, np.ndarray) and b.dtype == BF16 and b.shape == w.shape
    assert np.array_equal(b.view(np.uint16), w.astype(BF16).view(np.uint16))
    for fmt, cls, fn in [("fp8_block", Fp8BlockWeight, formats.quantize_fp8_block),
                         ("nvfp4", Nvfp4Weight, formats.quantize_nvfp4),
                         ("mxfp4", Mxfp4Weight, formats.quantize_mxfp4)]:
        got = formats.quantize(w, fmt)
        assert isinstance(got, cls) and got.shape == w.shape
        assert np.array_equal(got.dequantize(np.float64), fn(w).dequantize(np.float64))
        assert formats.weight_format(got) == fmt == got.format


def test_quantize_unknown_format_named():
    with pytest.raises(ValueError, match="'int4'"):
        formats.quantize(np.zeros((2, 32), np.float32), "int4")


def test_weight_format_and_dequantize_on_plain_arrays():
    f32 = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert formats.weight_format(f32) == "bf16"
    assert formats.weight_format(f32.astype(BF16)) == "bf16"
    got = formats.dequantize(f32.astype(BF16))
    assert got.dtype == np.float64 and np.array_equal(got, f32)  # 0..5 are exact in bf16


def test_check_scales_names_the_first_unusable_scale():
    """A corrupt or mis-read checkpoint must not reach the GPU as NaN scales: the device
    upload calls check_scales, which names the tensor, the field, the index and the value."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 130, 96)).astype(np.float32)
    f8 = formats.quantize(w, "fp8_block")
    f8.check_scales("gate")  # a clean one passes
    f8.scale_inv[1, 1, 0] = np.nan
    with pytest.raises(ValueError, match=r"gate\.scale_inv\[1, 1, 0\] = nan.*1 such in 4"):
        f8.check_scales("gate")
    nv = formats.quantize(w, "nvfp4")
    nv.check_scales("up")
    nv.scale.view(np.uint8)[0, 3, 2] = 0x7F  # e4m3's NaN
    with pytest.raises(ValueError, match=r"up\.weight_scale\[0, 3, 2\] = byte 0x7F"):
        nv.check_scales("up")
    nv = formats.quantize(w, "nvfp4")
    nv.scale_2[1] = np.inf
    with pytest.raises(ValueError, match=r"up\.weight_scale_2\[1\] = inf"):
        nv.check_scales("up")
    mx = formats.quantize(w, "mxfp4")
    mx.check_scales("down")
    mx.scales[1, 0, 2] = 255  # e8m0's NaN
    with pytest.raises(ValueError, match=r"down\.scales\[1, 0, 2\] = byte 0xFF"):
        mx.check_scales("down")


def _bf16_value(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)[0])


def _random_fp4_word(rng):
    """8 random e2m1 codes and the 32-bit word the GPU holds for them: code i in nibble i as
    stored, then repacked as the load does (formats.repack_fp4_words)."""
    nib = rng.integers(0, 16, 8)
    stored = int(sum(int(n) << (4 * j) for j, n in enumerate(nib)))
    return nib, _repacked(stored)


def _repacked(stored: int) -> int:
    b = np.array([stored], dtype=np.uint32).view(np.uint8)
    return int(formats.repack_fp4_words(b).view(np.uint32)[0])


def _rotr(v: int, r: int) -> int:
    return ((v >> r) | (v << (32 - r))) & 0xFFFFFFFF


def _fp4_pairs(v: int) -> list:
    """cuda/quant.cuh fp4x8_to_bf16_pairs before its scale multiply, on a repacked word v:
    pair i holds codes i and i + 4, each times 2^-126 as bf16 bits."""
    m = 0x81C081C0
    return [v & m, _rotr(v, 3) & m, _rotr(v, 6) & m, (((v & 0x001B001B) * 0x4108) & 0xFFFFFFFF) & m]


def test_fp4_word_repack_of_the_kernels_is_the_host_map():
    """cuda/quant.cuh fp4_word_repack (what cuda/repack.cu runs over every fp4 matrix at
    load), replayed line by line: it moves each stored bit where formats.fp4_word_bit_map
    says, on every single-bit word and on random ones, and unrepack_fp4_words undoes it. The
    GPU test runs the kernel itself; this keeps the two texts together where no GPU is."""
    from pathlib import Path

    src = (Path(formats.__file__).parent.parent / "cuda" / "quant.cuh").read_text()
    for line in ("return ((c & 7u) << 6) | ((c & 8u) << 12);",
                 "return ((c >> 2) & 1u) | (((c >> 3) & 1u) << 1) | ((c & 1u) << 3) | (((c >> 1) & 1u) << 4);",
                 "const unsigned p = fp4_code_as_pair_half((v >> (4 * i)) & 15u) | "
                 "(fp4_code_as_pair_half((v >> (16 + 4 * i)) & 15u) << 16);",
                 "const int r = 3 * i;  // rotate left by r", "out |= r ? (p << r) | (p >> (32 - r)) : p;",
                 "return out | fp4_code_as_pair3((v >> 12) & 15u) | (fp4_code_as_pair3(v >> 28) << 16);"):
        assert line in src, line

    def pair_half(c):
        return ((c & 7) << 6) | ((c & 8) << 12)

    def pair3(c):
        return ((c >> 2) & 1) | (((c >> 3) & 1) << 1) | ((c & 1) << 3) | (((c >> 1) & 1) << 4)

    def repack(v):
        out = 0
        for i in range(3):
            p = pair_half((v >> (4 * i)) & 15) | (pair_half((v >> (16 + 4 * i)) & 15) << 16)
            r = 3 * i
            out |= ((p << r) | (p >> (32 - r))) & 0xFFFFFFFF if r else p
        return out | pair3((v >> 12) & 15) | (pair3(v >> 28) << 16)

    dest = formats.fp4_word_bit_map()
    for b in range(32):
        assert repack(1 << b) == 1 << int(dest[b]), b
    rng = np.random.default_rng()
    words = rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32)
    host = formats.repack_fp4_words(words.view(np.uint8)).view(np.uint32)
    assert [repack(int(w)) for w in words] == [int(h) for h in host]
    assert np.array_equal(formats.unrepack_fp4_words(host.view(np.uint8)).view(np.uint32), words)
    assert formats.repack_fp4_words(np.zeros(8, np.uint8)).tolist() == [0] * 8  # the kernels' zero padding
    with pytest.raises(ValueError, match=r"\(3, 6\)"):  # rows of whole 4-byte words only
        formats.repack_fp4_words(np.zeros((3, 6), np.uint8))
    with pytest.raises(ValueError, match="uint16"):
        formats.repack_fp4_words(np.zeros(8, np.uint16))


def test_fp4_pair_tiling_script_finds_the_kernels_fourth_pair():
    """scripts/fp4_pair_tiling.py --schemes (the search behind the repacked words, NOTES.md
    v40): for the kernels' fourth pair (m, e0, e1, sign at bits 3, 4, 0, 1) it finds the
    multiply by 0x4108 (low half) that quant.cuh uses, for the stored nibble order the two-copy
    multiply the kernels took before (0x1040), and for bits needing four different shifts
    (m, e0, e1, sign at 3, 2, 1, 0) none."""
    import importlib.util
    from pathlib import Path

    path = Path(formats.__file__).parent.parent / "scripts" / "fp4_pair_tiling.py"
    spec = importlib.util.spec_from_file_location("fp4_pair_tiling", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dest = formats.fp4_word_bit_map()
    assert tuple(int(dest[12 + b]) for b in range(4)) == (3, 4, 0, 1)  # code 3's bits: the fourth pair
    assert ("lo", 0x4108) in mod.fourth_pair_constants((3, 4, 0, 1))
    assert ("lo", 0x1040) in mod.fourth_pair_constants((0, 1, 2, 3))
    assert mod.fourth_pair_constants((3, 2, 1, 0)) == []


def test_fp4_bit_placement_of_the_tensor_core_decode():
    """cuda/quant.cuh fp4x8_to_bf16_pairs, replayed in numpy on words the load repacked: a
    code's magnitude bits at bf16 bits 8..6 and its sign at bit 15 read as the e2m1 value
    times 2^-126 (the E = 0 codes as bf16 subnormals); pairs 0-2 by a mask (after a rotation
    for 1 and 2), pair 3 by one multiply of its masked bits (three copies that cannot
    overlap); the scales the decode multiplies by (nvfp4: e4m3 * 2^62; mxfp4: exponent
    field e + 62) are exact bf16 numbers, and code * scale * 2^-64 is an exact, normal bf16
    for every nvfp4 scale and for the mxfp4 scale bytes catalog.FP4_MMA_MXFP4_SCALE_BYTES admits."""
    from pathlib import Path

    from cupymoe import catalog

    bf16 = _bf16_value
    values = formats.e2m1_decode(np.arange(16, dtype=np.uint8)).astype(np.float64)
    rng = np.random.default_rng()
    words = [_random_fp4_word(rng) for _ in range(2000)]
    for i in range(4):  # every pair of codes in every pair slot, the other codes random
        for a in range(16):
            for b in range(16):
                nib = rng.integers(0, 16, 8)
                nib[i], nib[i + 4] = a, b
                words.append((nib, _repacked(int(sum(int(n) << (4 * j) for j, n in enumerate(nib))))))
    for nib, v in words:
        for i, p in enumerate(_fp4_pairs(v)):
            assert bf16(p & 0xFFFF) * 2.0 ** 126 == values[nib[i]]
            assert bf16(p >> 16) * 2.0 ** 126 == values[nib[i + 4]]
    # pair 3's multiply: its three copies of the masked bits are disjoint (no carries)
    x = 0x001B001B
    copies = [x << 3, x << 8, x << 14]
    assert all(copies[a] & copies[b] == 0 for a in range(3) for b in range(a + 1, 3))
    src = (Path(formats.__file__).parent.parent / "cuda" / "quant.cuh").read_text()
    for line in ("p[0] = v & FP4_PAIR_MASK;", "p[1] = __funnelshift_r(v, v, 3) & FP4_PAIR_MASK;",
                 "p[2] = __funnelshift_r(v, v, 6) & FP4_PAIR_MASK;",
                 "p[3] = ((v & 0x001B001Bu) * 0x4108u) & FP4_PAIR_MASK;", "#define FP4_PAIR_MASK 0x81C081C0u"):
        assert line in src, line
    e4m3 = np.arange(0x7F, dtype=np.uint8).view(formats.E4M3).astype(np.float64)  # every finite positive scale
    lo, hi = catalog.FP4_MMA_MXFP4_SCALE_BYTES
    mx = 2.0 ** (np.arange(lo, hi + 1) - 127)
    for scales, what in ((e4m3[e4m3 > 0], "nvfp4"), (mx, "mxfp4")):
        for s in scales:
            assert float(np.float64(s * 2.0 ** 62).astype(ml_dtypes.bfloat16)) == s * 2.0 ** 62, (what, s)
            w = values[values != 0] * s * 2.0 ** -64
            assert np.array_equal(w.astype(ml_dtypes.bfloat16).astype(np.float64), w), (what, s)
            assert np.abs(w).min() >= 2.0 ** -126, (what, s)  # normal: what the tensor cores take
    assert all(bf16((e + 62) << 7) == 2.0 ** (e - 127 + 62) for e in range(lo, hi + 1))
    assert bf16((hi + 1 + 62) << 7) == np.inf  # one past: why the range stops there


def test_fp4_bit_placement_of_the_grouped_gemm_tiles():
    """cuda/quant.cuh fp4x8_to_bf16_in_order, replayed in numpy: the four byte permutes put
    the pairs (i, i + 4) back in k order (element 2 i in the low half of word i); and
    gemm_common.cuh's multipliers keep every product exact: nvfp4 pairs times e4m3 * 2^62 give
    code * scale * 2^-64 (the epilogue's 2^64, quant.cuh gemm_weight_unscale), mxfp4 pairs
    times 2^(e - 1), bf16 exponent field e + 126, give code * 2^(e - 127) itself while the
    field is finite (FP4_PAIRS_MXFP4_MAX_SCALE_BYTE; past it the table lookup runs)."""
    import re
    from pathlib import Path

    def prmt(a, b, sel):  # __byte_perm without sign mode
        src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
        return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    bf16 = _bf16_value
    values = formats.e2m1_decode(np.arange(16, dtype=np.uint8)).astype(np.float64)
    rng = np.random.default_rng()
    for _ in range(500):
        nib, v = _random_fp4_word(rng)
        p = _fp4_pairs(v)
        o = [prmt(p[0], p[1], 0x5410), prmt(p[2], p[3], 0x5410), prmt(p[0], p[1], 0x7632), prmt(p[2], p[3], 0x7632)]
        got = [bf16((o[k // 2] >> (16 * (k % 2))) & 0xFFFF) * 2.0 ** 126 for k in range(8)]
        assert got == [values[n] for n in nib]
    src = (Path(formats.__file__).parent.parent / "cuda" / "quant.cuh").read_text()
    assert "0x5410), __byte_perm(p.z, p.w, 0x5410), __byte_perm(p.x, p.y, 0x7632)" in src
    top = int(re.search(r"#define FP4_PAIRS_MXFP4_MAX_SCALE_BYTE (\d+)u", src).group(1))
    for e in range(0, 256):
        field = e + 126
        if e <= top:
            assert field <= 254 and bf16(field << 7) == 2.0 ** (e - 1)
            for c in values[values != 0]:  # the pair (c * 2^-126) times 2^(e - 1): exact, as the table's
                exact = c * 2.0 ** (e - 127)
                assert float(np.float64(exact).astype(ml_dtypes.bfloat16)) == exact or exact < 2.0 ** -126
        else:
            assert field > 254  # 2^(e - 1) is no bf16 number
    for s in np.arange(1, 0x7F, dtype=np.uint8).view(formats.E4M3).astype(np.float64):
        w = values[values != 0] * s * 2.0 ** -64
        assert np.abs(w).min() >= 2.0 ** -126 and np.abs(w).max() < 2.0 ** 127


def test_fp4_to_e4m3_byte_permute_lookup_of_the_probe():
    """scripts/fp4_e4m3_decode_probe.cu fp4x8_to_e4m3x8, replayed in numpy (NOTES.md v39): on
    a word repacked at load (codes 0-3's magnitudes in bits 0-2 of nibbles 0-3, codes 4-7's in
    nibbles 4-7; code j's sign at bit 8 j + 7, code 4 + j's at bit 8 j + 3), one mask, two
    byte permutes into the table of the 8 magnitudes' e4m3 bytes, a shift and two sign merges
    give every e2m1 value as e4m3 exactly (byte j of the first register is code j, of the
    second code 4 + j). Its 7 operations a word are what the probe timed."""
    import re
    from pathlib import Path

    def prmt(a, b, sel):  # __byte_perm: a selector nibble's bit 3 would sign-replicate; masked off here
        src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
        assert all(((sel >> (4 * i)) & 8) == 0 for i in range(4))
        return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))

    def repack(nib) -> int:
        v = 0
        for j in range(4):
            v |= (int(nib[j]) & 7) << (4 * j) | (int(nib[j]) >> 3) << (8 * j + 7)
            v |= (int(nib[4 + j]) & 7) << (16 + 4 * j) | (int(nib[4 + j]) >> 3) << (8 * j + 3)
        return v

    src = (Path(formats.__file__).parent.parent / "scripts" / "fp4_e4m3_decode_probe.cu").read_text()
    lo, hi = (int(x, 16) for x in re.search(r"const unsigned lo = (0x[0-9A-F]+)u, hi = (0x[0-9A-F]+)u;", src).groups())
    assert "a = __byte_perm(lo, hi, m) | (v & 0x80808080u);" in src
    assert "b = __byte_perm(lo, hi, m >> 16) | ((v << 4) & 0x80808080u);" in src
    values = formats.e2m1_decode(np.arange(16, dtype=np.uint8)).astype(np.float64)
    e4m3 = lambda byte: float(np.array([byte], np.uint8).view(formats.E4M3).astype(np.float64)[0])  # noqa: E731
    rng = np.random.default_rng()
    words = [rng.integers(0, 16, 8) for _ in range(3000)] + [np.full(8, c) for c in range(16)]
    for nib in words:
        v = repack(nib)
        m = v & 0x77777777
        a = prmt(lo, hi, m & 0xFFFF) | (v & 0x80808080)
        b = prmt(lo, hi, m >> 16) | ((v << 4) & 0x80808080 & 0xFFFFFFFF)
        got = [e4m3((a >> (8 * j)) & 0xFF) for j in range(4)] + [e4m3((b >> (8 * j)) & 0xFF) for j in range(4)]
        assert got == [values[n] for n in nib]  # -0.0 == 0.0: the sign of zero is kept, and harmless


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4", "mxfp4"])
def test_quantizers_refuse_non_finite_weights_naming_the_first(fmt):
    """NaN and inf weights have no code: mxfp4 had turned a NaN into -0 and its group's other
    values into 2^-127-scaled garbage (inf: clipped to 6), fp8 and nvfp4 gave NaN codes that
    check_scales cannot see. Now refused, naming the first such weight."""
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones((3, 64), np.float32)
        w[2, 5] = bad
        with pytest.raises(ValueError, match=rf"weight\[2, 5\] = {bad}: only finite weights"):
            formats.quantize(w, fmt)


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4", "mxfp4"])
def test_quantizers_refuse_vectors_and_take_empty_stacks(fmt):
    with pytest.raises(ValueError, match=r"expected a \[\.\.\., out, in\] matrix \(stack\), found shape \(64,\)"):
        formats.quantize(np.ones(64, np.float32), fmt)
    empty = formats.quantize(np.zeros((0, 64), np.float32), fmt)  # nvfp4 had failed in numpy's max
    assert empty.shape == (0, 64) and formats.dequantize(empty).shape == (0, 64)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "nvfp4", "mxfp4"])
def test_quantizers_refuse_weights_no_format_encodes(fmt):
    """Complex weights quantized to their real part (a ComplexWarning only); 'bf16' skipped every check
    (NaN and 1-D passed, 3.4e38 rounded to Inf); a float64 1e300 became Inf with no name; a format that
    is no string raised TypeError."""
    w = np.ones((3, 64))
    with pytest.raises(formats.WeightError, match="expected real weights, found dtype complex128"):
        formats.quantize(w + 5j, fmt)
    for bad in (np.nan, 1e300):
        v = w.copy()
        v[2, 5] = bad
        with pytest.raises(formats.WeightError, match=rf"weight\[2, 5\] = {re.escape(str(bad))}: only finite weights"):
            formats.quantize(v, fmt)
    with pytest.raises(formats.WeightError, match=r"expected a \[\.\.\., out, in\] matrix"):
        formats.quantize(np.ones(64, np.float32), fmt)
    with pytest.raises(formats.OptionError, match=rf"quantize: format \['{fmt}'\] is no format name"):
        formats.quantize(w, [fmt])
    if fmt == "bf16":
        v = w.astype(np.float32)
        v[1, 1] = 3.4e38
        with pytest.raises(formats.WeightError, match=r"quantize\(bf16\)\[1, 1\] = .*past bfloat16's range"):
            formats.quantize(v, fmt)
        assert formats.quantize(w, fmt).dtype == formats.BF16


def test_tiny_blocks_quantize_without_nans():
    """Blocks whose magnitudes are float32 subnormals (amax / 448 or amax / 2688 rounds to
    zero or to a coarse subnormal): fp8's q and nvfp4's group scales had come out e4m3 NaN
    (fp8 silently: its check_scales reads only scale_inv). Now every code is finite and the
    largest weight comes back within e4m3's rounding of the coarse scale."""
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    for amax in [tiny, 3 * tiny, 2.0 ** -140, 8.5e-42, 5.1e-41, 1e-39, 2.0 ** -126]:
        w = np.zeros((2, 32), np.float32)
        w[0, 0], w[1, 31] = amax, -amax / 3
        fp8 = formats.quantize_fp8_block(w)
        assert np.isfinite(fp8.q.astype(np.float32)).all(), amax
        fp8.check_scales("w")
        assert abs(fp8.dequantize(np.float64)[0, 0] - float(np.float32(amax))) <= 2.0 ** -3 * float(np.float32(amax))
        nv = formats.quantize_nvfp4(w)
        nv.check_scales("w")  # had called the scale byte 0x7F a corrupt checkpoint
        deq = nv.dequantize(np.float64)
        assert np.isfinite(deq).all(), amax
        # e2m1 * scale * scale_2 in float32, as the kernels multiply: the very smallest
        # magnitudes underflow to zero there, the rest keep e2m1's rounding (a step of 1/2)
        assert deq[0, 0] == 0 or abs(deq[0, 0] - float(np.float32(amax))) <= 0.5 * float(np.float32(amax)), amax
        if amax >= 1e-39:
            assert deq[0, 0] > 0, amax


def test_mxfp4_dequantize_in_float64_reaches_the_largest_scales():
    """e8m0 byte 254 is a valid scale (2^127): 6 * 2^127 overflows float32 but not float64,
    which dequantize(np.float64) must return (it had multiplied in float32: inf)."""
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x47  # codes 7 (6.0) and 4 (2.0)
    w = formats.Mxfp4Weight(blocks, np.array([[254]], np.uint8)).dequantize(np.float64)
    assert w[0, 0] == 6.0 * 2.0 ** 127 and w[0, 1] == 2.0 ** 128 and w[0, 2] == 0


def test_nvfp4_container_needs_a_matrix():
    for packed in (np.zeros(8, np.uint8), np.zeros((), np.uint8)):
        with pytest.raises(ValueError, match=r"Nvfp4Weight.packed: expected \[\.\.\., out, in/2\]"):
            formats.Nvfp4Weight(packed, np.zeros(1, np.uint8), 1.0)


def test_format_refusals_are_cupymoe_errors():
    """The containers and quantizers refuse with cupymoe.WeightError (an unknown format name:
    OptionError), still ValueErrors for older callers; before, bare ValueErrors."""
    from cupymoe import OptionError, WeightError

    with pytest.raises(WeightError, match=r"Fp8BlockWeight.scale_inv: expected shape \(1, 1\)"):
        Fp8BlockWeight(np.zeros((4, 8), np.uint8), np.ones((2, 2), np.float32))
    with pytest.raises(WeightError, match="pack_nibbles: last axis must be even"):
        formats.pack_nibbles(np.zeros(3, np.uint8))
    with pytest.raises(WeightError, match="only finite weights"):
        formats.quantize(np.full((2, 32), np.nan, np.float32), "mxfp4")
    with pytest.raises(OptionError, match="quantize: unknown format 'int3'"):
        formats.quantize(np.zeros((2, 32), np.float32), "int3")
    assert issubclass(WeightError, ValueError) and issubclass(OptionError, ValueError)


def test_device_containers_check_their_scale_shapes():
    """Containers of CuPy arrays check shapes too (through `.shape`, nothing copied): a [1, 1, 1]
    scale with [15, 64, 96] weights had been accepted, and the layer then computed a per-expert
    scale stride of 0 and the kernels read past the scale buffer."""
    from _fakes import FakeDeviceArray as D

    from cupymoe import WeightError

    q = D(np.zeros((15, 64, 96), np.uint8))
    with pytest.raises(WeightError, match=r"Fp8BlockWeight\.scale_inv: expected shape \(15, 1, 1\) for q "
                                          r"\(15, 64, 96\), found \(1, 1, 1\)"):
        Fp8BlockWeight(q, D(np.ones((1, 1, 1), np.float32)))
    with pytest.raises(WeightError, match=r"Fp8BlockWeight\.q: expected \[\.\.\., out, in\], found shape \(96,\)"):
        Fp8BlockWeight(D(np.zeros(96, np.uint8)), D(np.ones(1, np.float32)))
    assert Fp8BlockWeight(q, D(np.ones((15, 1, 1), np.float32))).shape == (15, 64, 96)

    packed = D(np.zeros((15, 64, 48), np.uint8))
    with pytest.raises(WeightError, match=r"Nvfp4Weight\.scale: expected shape \(15, 64, 6\) for packed "
                                          r"\(15, 64, 48\), found \(1, 1, 1\)"):
        Nvfp4Weight(packed, D(np.zeros((1, 1, 1), np.uint8)), np.ones(15, np.float32))
    with pytest.raises(WeightError, match=r"Nvfp4Weight\.scale_2: expected one value per matrix, shape \(15,\)"):
        Nvfp4Weight(packed, D(np.zeros((15, 64, 6), np.uint8)), np.ones(3, np.float32))
    with pytest.raises(WeightError, match=r"Nvfp4Weight: in=20 is not a multiple of 16"):
        Nvfp4Weight(D(np.zeros((15, 64, 10), np.uint8)), D(np.zeros((15, 64, 1), np.uint8)), 1.0)
    assert Nvfp4Weight(packed, D(np.zeros((15, 64, 6), np.uint8)), 1.0).shape == (15, 64, 96)

    blocks = D(np.zeros((15, 64, 3, 16), np.uint8))
    with pytest.raises(WeightError, match=r"Mxfp4Weight\.scales: expected shape \(15, 64, 3\), found \(1, 1, 1\)"):
        Mxfp4Weight(blocks, D(np.zeros((1, 1, 1), np.uint8)))
    with pytest.raises(WeightError, match=r"Mxfp4Weight\.blocks: expected \[\.\.\., out, in/32, 16\], found "
                                          r"\(15, 64, 3, 8\)"):
        Mxfp4Weight(D(np.zeros((15, 64, 3, 8), np.uint8)), D(np.zeros((15, 64, 3), np.uint8)))
    assert Mxfp4Weight(blocks, D(np.zeros((15, 64, 3), np.uint8))).shape == (15, 64, 96)
