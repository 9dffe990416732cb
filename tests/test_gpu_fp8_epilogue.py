"""GPU: the w8a8 gate/up epilogue's exact reciprocal and division (cuda/fp8_gemm.cuh rcp_rn_nearest,
silu_rn_nearest, div_rn_nearest) on the hardware, exhaustively:
every float y in [1, 2^125] against 1.0f / y (rcp.rn) from the hardware's rcp.approx, every float g > -80
(with a u of each) against activation<ACT_SILU>, and every float a over 16 scales against a / sc (div.rn)
wherever |q| >= 2^-11 and by e4m3 code everywhere, bit for bit. tests/test_fp8_epilogue.py checks the
rules themselves on the CPU. sm_90a."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import jit, testing
from cupymoe.knobs import Knobs

pytestmark = pytest.mark.gpu

SOURCE = r'''
#include "fp8_gemm.cuh"

// out: mismatches, rcp.approx unlike 1 / y rounded, rcp.approx more than one float off, the least y missed
extern "C" __global__ void check_rcp(unsigned base, unsigned n, unsigned long long* out) {
    unsigned long long bad = 0, off = 0, far = 0, first = ~0ull;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float y = __uint_as_float(base + i), want = 1.0f / y;
        float q;
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(q) : "f"(y));
        const int dq = __float_as_int(q) - __float_as_int(want);
        off += dq != 0;
        far += dq > 1 || dq < -1;
        if (__float_as_int(rcp_rn_nearest(y)) != __float_as_int(want)) {
            ++bad;
            first = min(first, (unsigned long long)(base + i));
        }
    }
    atomicAdd(out, bad);
    atomicAdd(out + 1, off);
    atomicAdd(out + 2, far);
    atomicMin(out + 3, first);
}

// out: a checked, quotients missed (|q| >= 2^-11: below, q is the rule's), codes missed, the least a bits missed
extern "C" __global__ void check_div(float sc, unsigned long long* out) {
    const float binv = 1.0f / sc;
    unsigned long long seen = 0, bad = 0, codes = 0, first = ~0ull;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += gridDim.x * blockDim.x) {
        const float a = __uint_as_float((unsigned)i);
        if (!(fabsf(a) <= 896.0f * sc)) continue;  // the epilogue's a: |a| <= amax = 448 sc
        const float want = a / sc, got = div_rn_nearest(a, sc, binv);
        ++seen;
        const bool miss = fabsf(a * binv) >= 0x1p-11f && __float_as_int(got) != __float_as_int(want);
        const bool code_miss = e4m3x2_codes(got, 0.0f) != e4m3x2_codes(want, 0.0f);
        bad += miss;
        codes += code_miss;
        if (miss || code_miss) first = min(first, i);
    }
    atomicAdd(out, seen);
    atomicAdd(out + 1, bad);
    atomicAdd(out + 2, codes);
    atomicMin(out + 3, first);
}

// out: g checked, mismatches, the least g bits missed
extern "C" __global__ void check_silu(unsigned long long* out) {
    unsigned long long seen = 0, bad = 0, first = ~0ull;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += gridDim.x * blockDim.x) {
        const float g = __uint_as_float((unsigned)i);
        if (!(g > -80.0f)) continue;
        const float u = __uint_as_float(((unsigned)i * 2654435761u) & 0xBFFFFFFFu);  // |u| < 2
        const float got = silu_rn_nearest(g, u), want = activation<ACT_SILU>(g, u, 0.0f, 0.0f);
        ++seen;
        if (__float_as_int(got) != __float_as_int(want) && !(got != got && want != want)) {
            ++bad;
            first = min(first, i);
        }
    }
    atomicAdd(out, seen);
    atomicAdd(out + 1, bad);
    atomicMin(out + 2, first);
}
'''


def compile_checks(arch: str = "sm_90a") -> bytes:
    nvrtc = jit._nvrtc()
    prog = nvrtc.createProgram(SOURCE, "fp8_epilogue_checks.cu", (), ())
    try:
        nvrtc.compileProgram(prog, jit.compile_options(arch, Knobs()))
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _module():
    import cupy

    if not testing.on_sm90a():
        pytest.skip("the w8a8 kernels need sm_90a")
    mod = cupy.cuda.function.Module()
    mod.load(compile_checks())
    grid, block = (cupy.cuda.Device().attributes["MultiProcessorCount"] * 8,), (256,)
    return mod, grid, block


def test_the_rule_on_every_y_and_every_g():
    import cupy

    mod, grid, block = _module()
    out = cupy.array([0, 0, 0, 2**64 - 1], dtype=cupy.uint64)
    base, top = 0x3F800000, 0x7E000000  # 1 .. 2^125
    mod.get_function("check_rcp")(grid, block, (np.uint32(base), np.uint32(top - base + 1), out))
    bad, off, far, first = (int(v) for v in out.get())
    print(f"\nrcp.approx: {off} of {top - base + 1} y not 1 / y rounded, {far} more than one float off")
    assert bad == 0, f"{bad} y missed, the least {np.uint32(first).view(np.float32)!r}"
    out = cupy.array([0, 0, 2**64 - 1], dtype=cupy.uint64)
    mod.get_function("check_silu")(grid, block, (out,))
    seen, bad, first = (int(v) for v in out.get())
    assert seen == 0x7F800001 + (0xC2A00000 - 0x80000000)  # +0 .. +inf, and -0 .. -80 (bits 0xC2A00000) less -80
    assert bad == 0, f"{bad} g missed, the least {np.uint32(first).view(np.float32)!r}"


# the least scale the rule takes (2^-90), amax / 448 of bf16 and plain amax from 2^-60 to 2^60; with them the
# four scales of [1, 2) whose 1 / sc rounds worst (tests/test_fp8_epilogue.py _worst_reciprocals)
SCALES = [2.0**-90, 1 / 448, 3 / 448, 0.3, 2.0**-60 * 1.7 / 448, 2.0**60 / 448]


def test_the_division_on_every_a():
    import cupy

    mod, grid, block = _module()
    from test_fp8_epilogue import _worst_reciprocals

    for sc in [np.float32(v) for v in SCALES + [float(b) for b in _worst_reciprocals(4)]]:
        out = cupy.array([0, 0, 0, 2**64 - 1], dtype=cupy.uint64)
        mod.get_function("check_div")(grid, block, (sc, out))
        seen, bad, codes, first = (int(v) for v in out.get())
        assert seen == 2 * (int((np.float32(896) * sc).view(np.uint32)) + 1), sc  # every a of both signs
        assert bad == 0 and codes == 0, f"sc {sc!r}: {bad} quotients, {codes} codes missed, the least " \
            f"a {np.uint32(first).view(np.float32)!r}"

