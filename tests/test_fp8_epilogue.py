"""The w8a8 gate/up epilogue's exact division and reciprocal (cuda/fp8_gemm.cuh div_rn_nearest,
rcp_rn_nearest), emulated in numpy float32: one Newton step by fmas from q (Markstein), the reciprocal's
all-ones significands in closed form.

The rule is checked against IEEE division wherever the quotient reaches the e4m3 codes (|q| >= 2^-11, b >=
2^-90; below, the codes of q and of a / b are the same signed zero): on random rows of scales over
2^-80 .. 2^60 (bf16 values and plain floats, zeros of both signs, the group's own amax), at every e4m3
rounding midpoint and its float neighbours, and on every a of a binade over the scales whose 1 / b rounds
worst; the reciprocal on every y of a binade from any q within 1 ulp of 1 / y (the error PTX allows
rcp.approx). The fma emulation itself is checked against exact rationals."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn
REACH = F32(2.0 ** -11)  # |q| below: the quotient's e4m3 code is a signed zero whatever its last bits


def _fma(a, b, c):
    """a b + c rounded once to float32: the float64 product of two floats is exact, TwoSum gives the
    float64 sum and its exact error, and the sum rounded to odd (53 >= 24 + 2 bits) then rounds to float32
    as the exact value would."""
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def _step(x, k):
    return (x.view(np.int32) + np.int32(k)).view(F32)


def div_rn_nearest(a, b):
    binv = (F32(1) / b).astype(F32)
    q = (a * binv).astype(F32)
    best = _fma(_fma(-b, q, a), binv, q)
    return np.where(np.abs(q) < REACH, q, best), q


def rcp_rn_nearest(y, q):
    """1 / y by the kernel's rule from q, an approximation within 1 ulp of 1 / y."""
    yb = y.view(np.int32)
    ones = (yb & 0x7FFFFF) == 0x7FFFFF
    closed = (np.int32(0x7E800001) - (yb & np.int32(0x7F800000))).view(F32)
    return np.where(ones, closed, _fma(_fma(-y, q, F32(1)), q, q))


def _codes(v):
    return np.clip(v, -448, 448).astype(E4M3).view(np.uint8)


def _same_where_reached(want, got, q):
    reach = np.abs(q) >= REACH
    return np.array_equal(want.view(np.int32)[reach], got.view(np.int32)[reach]) and \
        np.array_equal(_codes(want), _codes(got))


# --- the fma emulation against exact rationals


def _round_f32(x: Fraction) -> float:
    """x rounded to the nearest float32, ties to even (subnormals included), exactly."""
    if x == 0:
        return 0.0
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    e -= Fraction(2) ** e > x  # 2^e <= x < 2^(e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    m = x / ulp
    n, rem = divmod(m.numerator, m.denominator)
    n += 2 * rem > m.denominator or (2 * rem == m.denominator and n % 2 == 1)
    return sign * float(n * ulp)


def test_the_fma_emulation_rounds_once():
    rng = np.random.default_rng(12)
    n = 4000
    a = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-62, 62, n))).astype(F32)
    b = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-62, 62, n))).astype(F32)
    c = (-(a.astype(np.float64) * b)).astype(F32)  # the remainder's case: c cancels most of a b
    c[::2] = _step(c[::2], rng.integers(-3, 4, c[::2].size))
    c[1::4] = (rng.uniform(-2, 2, c[1::4].size) * np.exp2(rng.integers(-100, 40, c[1::4].size))).astype(F32)
    c[3::8] = (a[3::8].astype(np.float64) * b[3::8] * (1 + 2.0 ** -25)).astype(F32)  # near float32 midpoints
    got = _fma(a, b, c)
    for ai, bi, ci, gi in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        assert gi == _round_f32(Fraction(ai) * Fraction(bi) + Fraction(ci)), (ai, bi, ci)


def test_the_rounding_helper_takes_ties_to_even():
    one = Fraction(1)
    assert _round_f32(one + Fraction(1, 2**24)) == 1.0
    assert _round_f32(one + Fraction(3, 2**24)) == 1.0 + 2.0 ** -22
    assert _round_f32(Fraction(3, 2**150)) == 2.0 ** -148  # subnormal tie, to even
    assert _round_f32(Fraction(-5, 2**151)) == -(2.0 ** -149)


# --- division


def test_the_division_rounds_as_division_on_random_rows():
    rng = np.random.default_rng(7)
    for trial in range(12):
        n = 250_000
        amax = np.exp2(rng.uniform(-80 if trial % 3 == 0 else -20, 60, n)).astype(F32)
        sc = (amax / F32(448)).astype(F32)
        a = (amax * rng.uniform(-1, 1, n) ** rng.integers(1, 12, n)).astype(F32)
        a[::97], a[1::97], a[2::97], a[3::97] = amax[::97], -amax[1::97], 0.0, -0.0
        if trial % 2:  # bf16 values, as the kernel's activations are
            a = (a.view(np.uint32) & 0xFFFF0000).view(F32)
        got, q = div_rn_nearest(a, sc)
        assert _same_where_reached((a / sc).astype(F32), got, q), trial


def _e4m3_midpoints():
    """Every point where the e4m3 rounding changes: halfway between neighbouring normal codes
    ((1 + (2 m + 1) / 16) 2^e, e = -6 .. 8, up to 432: 448 is the largest code) and subnormal ones
    ((k + 1/2) 2^-9, the last one halfway to 2^-6)."""
    normal = [(1 + (2 * m + 1) / 16) * 2.0 ** e for e in range(-6, 9) for m in range(8)]
    return np.array([v for v in normal if v < 464] + [(k + 0.5) * 2.0 ** -9 for k in range(8)])


def test_the_midpoints_are_where_the_codes_change():
    mids = _e4m3_midpoints()
    below, above = (mids * (1 - 2.0 ** -20)).astype(F32), (mids * (1 + 2.0 ** -20)).astype(F32)
    assert mids.size == 8 * 15 - 2 + 8 and np.all(_codes(below) + 1 == _codes(above))


def test_the_division_at_e4m3_midpoints():
    rng = np.random.default_rng(8)
    mids = _e4m3_midpoints()
    for _ in range(20):
        sc = (np.exp2(rng.uniform(-60, 60, mids.size)) / 448).astype(F32)
        base = (mids * sc.astype(np.float64)).astype(F32)
        for step in range(-3, 4):
            a = _step(base, step)
            want, (got, _) = (a / sc).astype(F32), div_rn_nearest(a, sc)
            assert np.array_equal(want.view(np.int32), got.view(np.int32))
            assert np.array_equal(_codes(want), _codes(got))


def _binade():
    """Every float of [1, 2)."""
    return (np.int32(0x3F800000) + np.arange(1 << 23, dtype=np.int32)).view(F32)


def _worst_reciprocals(count):
    """The b of [1, 2) whose 1 / b rounded is farthest from 1 / b (relative): where q = a (1 / b) strays
    most from a / b. b (1 / b rounded) is exact in float64."""
    b = _binade()
    err = np.abs(b.astype(np.float64) * (F32(1) / b).astype(F32) - 1)
    return b[np.argsort(err)[-count:]]


def test_the_division_on_every_a_of_a_binade():
    """Every a of [1, 2) (both signs by symmetry) over the four worst b, b = 1, the all-ones b and two
    at random: quotients in (1/2, 2), so q's distance from a / b in ulps covers both of its binades. A
    power of two times a or b moves every value of the rule by that power, but where the remainder
    a - b q turns subnormal (b near 2^-90), and there q is already a / b rounded. Why these b suffice
    for the rule: where a / b is in [1, 2), q is faithful, so Markstein's step rounds it; below 1 a
    miss needs a, b >= 2 - 3.5 2^-23 with b the all-ones significand, which the all-ones b covers."""
    rng = np.random.default_rng(13)
    a = _binade()
    bs = np.concatenate([_worst_reciprocals(4), np.array([1.0, 2 - 2.0 ** -23], F32),
                         _binade()[rng.integers(0, 1 << 23, 2)]]).astype(F32)
    off = 0
    for b in bs:
        want = (a / b).astype(F32)
        got, q = div_rn_nearest(a, np.full_like(a, b))
        off += int(np.count_nonzero(q != want))
        assert np.array_equal(want.view(np.int32), got.view(np.int32)), float(b)
    assert off > 0  # q itself misses somewhere: the rule is what makes these exact


# --- the SiLU's sigmoid 1 / y, y = 1 + e^-g


def _within_one_ulp(y, q):
    """|q - 1 / y| <= 1 ulp of 1 / y's binade, exactly: q y is exact in float64, and so is ulp y."""
    yb = y.view(np.int32)
    m = ((yb >> 23) & 0xFF) - 127  # 2^m <= y < 2^(m + 1), so 2^-(m + 1) < 1 / y <= 2^-m
    binade = np.exp2(np.where((yb & 0x7FFFFF) == 0, -m, -m - 1).astype(np.float64))
    yd = y.astype(np.float64)
    with np.errstate(invalid="ignore"):  # y = inf (g under -88.7): never taken
        return np.abs(q.astype(np.float64) * yd - 1) <= binade * 2.0 ** -23 * yd


def _approx(rng, y):
    """1 / y rounded, moved by -1, 0 or +1 float where that stays within 1 ulp of 1 / y, the bound PTX
    gives rcp.approx and Markstein's step needs (tests/test_gpu_fp8_epilogue.py checks the hardware's)."""
    want = (F32(1) / y).astype(F32)
    q = _step(want, rng.integers(-1, 2, y.size).astype(np.int32))
    return want, np.where(_within_one_ulp(y, q), q, want)


def _check_rcp(rng, y):
    assert y.dtype == F32 and np.all((y >= 1) & (y <= F32(2.0 ** 125)))
    want, q = _approx(rng, y)
    got = rcp_rn_nearest(y, q)
    assert np.array_equal(want.view(np.int32), got.view(np.int32))


def test_the_reciprocal_on_random_y():
    rng = np.random.default_rng(9)
    for trial in range(12):
        n = 250_000
        e = rng.integers(0, 125, n)
        m = rng.integers(0, 1 << 23, n)
        if trial % 3 == 1:  # next to the powers of two, above and below
            m = np.where(rng.random(n) < 0.5, rng.integers(0, 64, n), (1 << 23) - 1 - rng.integers(0, 64, n))
        y = ((e + 127) << 23 | m).astype(np.int32).view(F32)
        y[::101], y[1::101] = F32(1), F32(2.0 ** 125)
        if trial % 2:  # bf16 values
            y = (y.view(np.uint32) & 0xFFFF0000).view(F32)
        _check_rcp(rng, y)


def test_the_reciprocal_on_every_y_of_a_binade():
    """Every y of [1, 2) from each q one float below, at and above 1 / y rounded that is within 1 ulp of
    1 / y. A power of two times y moves every value by its inverse while 1 / y stays
    normal: y up to 2^125 (its top, 2^125, is 1 times a power of two)."""
    y = _binade()
    want = (F32(1) / y).astype(F32)
    for k in (-1, 0, 1):
        q = _step(want, k)
        keep = _within_one_ulp(y, q)
        got = rcp_rn_nearest(y[keep], q[keep])
        assert np.array_equal(want[keep].view(np.int32), got.view(np.int32)), k
        assert keep.mean() > 0.25, k


def test_the_fma_reciprocal_of_a_power_of_two_from_two_floats_below():
    """y = 2^k: 1 / y is a float at a binade's foot, and the floats below it are half as far apart, so
    1 ulp of 1 / y reaches two floats below; from there (and one below, at, one above) one step is exact."""
    y = (np.float64(2.0) ** np.arange(0, 126)).astype(F32)
    want = (F32(1) / y).astype(F32)
    for k in (-2, -1, 0, 1):
        q = _step(want, k)
        assert np.all(_within_one_ulp(y, q)), k
        assert np.array_equal(rcp_rn_nearest(y, q).view(np.int32), want.view(np.int32)), k
    assert not np.all(_within_one_ulp(y, _step(want, -3)))


def test_one_newton_step_misses_only_all_ones_significands():
    """The closed form is needed: one step from 1 / y rounded plus one float misses at the
    all-ones significand, and the closed form is 1 / y rounded there in every binade of the range."""
    y = F32(2 - 2.0 ** -23)
    want = (F32(1) / y).astype(F32)
    q = _step(np.array([want]), 1)
    assert _fma(_fma(-y, q, F32(1)), q, q)[0] != want
    ones = ((np.arange(127, 127 + 125) << 23) | 0x7FFFFF).astype(np.int32).view(F32)
    closed = (np.int32(0x7E800001) - (ones.view(np.int32) & np.int32(0x7F800000))).view(F32)
    assert np.array_equal(closed, (F32(1) / ones).astype(F32))


def test_the_reciprocal_on_the_silu_y():
    """y = 1 + e^-g of g over -90 .. 90 (plain floats and bf16 values), as the kernel picks:
    rcp_rn_nearest where every g of the thread's 32 exceeds -80 (then y < 2^125), else the division;
    the product g (1 / y) u equals the division's bit for bit either way."""
    rng = np.random.default_rng(10)
    for trial in range(8):
        n = 32 * 8192
        g = rng.uniform(*[(-90, 90), (-20, 90), (-90, 20), (-20, 20)][trial % 4], n).astype(F32)
        g[::7] = rng.normal(0, 4, g[::7].size)
        if trial % 2:
            g = (g.view(np.uint32) & 0xFFFF0000).view(F32)
        u = rng.normal(0, 3, n).astype(F32)
        with np.errstate(over="ignore"):
            y = (F32(1) + np.exp(-g)).astype(F32)  # inf under g = -88.7
        fast = np.repeat((g > -80).reshape(-1, 32).all(axis=1), 32)
        assert np.all(y[g > -80] < F32(2.0 ** 125))
        _, q = _approx(rng, y)
        with np.errstate(over="ignore", invalid="ignore"):
            rule = rcp_rn_nearest(np.where(fast, y, F32(1)), np.where(fast, q, F32(1)))
            got = (g * np.where(fast, rule, F32(1) / y)).astype(F32) * u
            ref = (g * (F32(1) / y)).astype(F32) * u
        assert np.array_equal(got.view(np.int32), ref.view(np.int32)), trial
        assert fast.any() and (trial % 4 in (1, 3) or not fast.all()), trial
        _check_rcp(rng, y[fast])
