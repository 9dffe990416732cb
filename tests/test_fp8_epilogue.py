"""The w8a8 gate/up epilogue's division rule (cuda/fp8_gemm.cuh div_rn_nearest), emulated in
numpy float32: of q = a (1 / b) and its two neighbours, the one with the least remainder
|a - b q| (one rounding, as fma gives it) is a / b as IEEE division rounds it, wherever the
quotient reaches the e4m3 codes (|a / b| >= 2^-11) and b >= 2^-90; below 2^-11 the codes of q
and of a / b are the same signed zero. Checked on random rows of scales over 2^-80 .. 2^60 (bf16
values and plain floats, zeros of both signs, the group's own amax) and on quotients at every
e4m3 rounding midpoint and their float neighbours. The SiLU's reciprocal rule (rcp_rn_nearest) below."""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3 = ml_dtypes.float8_e4m3fn


def _fma(a, b, c):
    # a b + c rounded once: the product of two floats is exact in float64, and the remainders
    # here are small multiples of its last place, so the float64 sum is exact too
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def div_rn_nearest(a, b):
    binv = (F32(1) / b).astype(F32)
    q = (a * binv).astype(F32)
    lo, hi = (q.view(np.int32) - 1).view(F32), (q.view(np.int32) + 1).view(F32)
    r, rl, rh = (np.abs(_fma(-b, c, a)) for c in (q, lo, hi))
    best = np.where(rl < r, lo, q)
    best = np.where(rh < np.minimum(r, rl), hi, best)
    return np.where(np.abs(q) < F32(2.0 ** -11), q, best)


def _codes(v):
    return np.clip(v, -448, 448).astype(E4M3).view(np.uint8)


def test_the_rule_rounds_as_division_on_random_rows():
    rng = np.random.default_rng(7)
    for trial in range(12):
        n = 250_000
        amax = np.exp2(rng.uniform(-80 if trial % 3 == 0 else -20, 60, n)).astype(F32)
        sc = (amax / F32(448)).astype(F32)
        a = (amax * rng.uniform(-1, 1, n) ** rng.integers(1, 12, n)).astype(F32)
        a[::97], a[1::97], a[2::97], a[3::97] = amax[::97], -amax[1::97], 0.0, -0.0
        if trial % 2:  # bf16 values, as the kernel's activations are
            a = (a.view(np.uint32) & 0xFFFF0000).view(F32)
        want, got = (a / sc).astype(F32), div_rn_nearest(a, sc)
        reach = np.abs(want) >= F32(2.0 ** -11)
        assert np.array_equal(want.view(np.int32)[reach], got.view(np.int32)[reach]), trial
        assert np.array_equal(_codes(want), _codes(got)), trial


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


def test_the_rule_at_e4m3_midpoints():
    rng = np.random.default_rng(8)
    mids = _e4m3_midpoints()
    for _ in range(20):
        sc = (np.exp2(rng.uniform(-60, 60, mids.size)) / 448).astype(F32)
        base = (mids * sc.astype(np.float64)).astype(F32)
        for step in range(-3, 4):
            a = (base.view(np.int32) + step).view(F32)
            want, got = (a / sc).astype(F32), div_rn_nearest(a, sc)
            assert np.array_equal(want.view(np.int32), got.view(np.int32))
            assert np.array_equal(_codes(want), _codes(got))


# The SiLU's sigmoid 1 / y, y = 1 + e^-g, by rcp_rn_nearest (cuda/fp8_gemm.cuh): of q, an approximation of
# 1 / y within 1 ulp (rcp.approx.ftz; here the exact reciprocal moved by -1, 0 or +1 float at random), and its
# two neighbours, the one with the least remainder |1 - y q| is 1 / y as rcp.rn rounds it, for 1 <= y < 2^125.


def rcp_rn_nearest(y, q):
    one = np.ones_like(y)
    lo, hi = (q.view(np.int32) - 1).view(F32), (q.view(np.int32) + 1).view(F32)
    r, rl, rh = (np.abs(_fma(-y, c, one)) for c in (q, lo, hi))
    best = np.where(rl < r, lo, q)
    return np.where(rh < np.minimum(r, rl), hi, best), np.stack([r, rl, rh])


def _approx(rng, y):
    """1 / y rounded, moved by -1, 0 or +1 float: any error rcp.approx's 1 ulp allows."""
    want = (F32(1) / y).astype(F32)
    return want, (want.view(np.int32) + rng.integers(-1, 2, y.size).astype(np.int32)).view(F32)


def _check_rcp(rng, y):
    assert y.dtype == F32 and np.all((y >= 1) & (y <= F32(2.0 ** 125)))
    want, q = _approx(rng, y)
    got, res = rcp_rn_nearest(y, q)
    assert np.array_equal(want.view(np.int32), got.view(np.int32))
    # no ties: one candidate alone has the least remainder (the exact reciprocals' among them)
    assert np.all(np.sum(res == res.min(axis=0), axis=0) == 1)


def test_the_reciprocal_rule_on_random_y():
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


def test_the_reciprocal_rule_on_the_silu_y():
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
        want, q = _approx(rng, y)
        with np.errstate(over="ignore", invalid="ignore"):
            rule = rcp_rn_nearest(np.where(fast, y, F32(1)), np.where(fast, q, F32(1)))[0]
            got = (g * np.where(fast, rule, F32(1) / y)).astype(F32) * u
            ref = (g * (F32(1) / y)).astype(F32) * u
        assert np.array_equal(got.view(np.int32), ref.view(np.int32)), trial
        assert fast.any() and (trial % 4 in (1, 3) or not fast.all()), trial
        _check_rcp(rng, y[fast])


def test_one_ulp_is_one_float_and_the_remainders_are_exact():
    """What the rule rests on, in exact arithmetic on y next to the powers of two (and at random): a float
    within 1 ulp of 1 / y (the ulp of 1 / y's binade) is 1 / y rounded or a neighbour, but for y = 2^k,
    whose 1 / y is a float that rcp.approx should return itself (tests/test_gpu_fp8_epilogue.py checks
    every y); the float64 remainders 1 - y q are exact, so rounded to float32 they are fma's."""
    from fractions import Fraction

    rng = np.random.default_rng(11)
    e = rng.integers(0, 125, 3000)
    m = np.concatenate([rng.integers(0, 8, 1000), (1 << 23) - 1 - rng.integers(0, 8, 1000),
                        rng.integers(0, 1 << 23, 1000)])
    y = ((e + 127) << 23 | m).astype(np.int32).view(F32)
    want = (F32(1) / y).astype(F32)
    for yi, wi in zip(y.tolist(), want.tolist()):
        exact = 1 / Fraction(yi)
        k = exact.numerator.bit_length() - exact.denominator.bit_length()
        k -= Fraction(2) ** k > exact  # 2^k <= 1 / y < 2^(k + 1)
        ulp = Fraction(2) ** (k - 23)
        bits = np.array([wi], F32).view(np.int32)[0]
        for step in (-2, -1, 0, 1, 2):  # every candidate of a q at most one float off 1 / y rounded
            qi = float(np.array([bits + step], np.int32).view(F32)[0])
            if abs(step) == 2:  # but 2^-k less two floats of [2^(k-1), 2^k): 1 ulp of 1 / 2^k exactly
                assert abs(Fraction(qi) - exact) > ulp or (exact.numerator == 1 and step == -2), (yi, step)
            assert Fraction(1.0 - yi * qi) == 1 - Fraction(yi) * Fraction(qi), (yi, step)
