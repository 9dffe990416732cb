"""The w8a8 gate/up epilogue's division rule (cuda/fp8_gemm.cuh div_rn_nearest), emulated in
numpy float32: of q = a (1 / b) and its two neighbours, the one with the least remainder
|a - b q| (one rounding, as fma gives it) is a / b as IEEE division rounds it, wherever the
quotient reaches the e4m3 codes (|a / b| >= 2^-11) and b >= 2^-90; below 2^-11 the codes of q
and of a / b are the same signed zero. Checked on random rows of scales over 2^-80 .. 2^60 (bf16
values and plain floats, zeros of both signs, the group's own amax) and on quotients at every
e4m3 rounding midpoint and their float neighbours."""

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


def test_the_rule_at_e4m3_midpoints():
    rng = np.random.default_rng(8)
    mids = np.array([(1 + (2 * m + 1) / 16) * 2.0 ** e for e in range(-9, 9) for m in range(16)])
    for _ in range(20):
        sc = (np.exp2(rng.uniform(-60, 60, mids.size)) / 448).astype(F32)
        base = (mids * sc.astype(np.float64)).astype(F32)
        for step in range(-3, 4):
            a = (base.view(np.int32) + step).view(F32)
            want, got = (a / sc).astype(F32), div_rn_nearest(a, sc)
            assert np.array_equal(want.view(np.int32), got.view(np.int32))
            assert np.array_equal(_codes(want), _codes(got))
