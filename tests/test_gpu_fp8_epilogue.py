"""GPU: the w8a8 SiLU's reciprocal rule (cuda/fp8_gemm.cuh rcp_rn_nearest, silu_rn_nearest) on the
hardware's rcp.approx, exhaustively: every float y in [1, 2^125] against 1.0f / y (rcp.rn), and every
float g > -80 (with a u of each) against activation<ACT_SILU>, bit for bit. tests/test_fp8_epilogue.py
checks the rule itself on the CPU, for any approximation within one float of 1 / y rounded. sm_90a."""

from __future__ import annotations

import numpy as np
import pytest

from cupymoe import jit, testing

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
        nvrtc.compileProgram(prog, jit.compile_options(arch))
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def test_the_rule_on_every_y_and_every_g():
    import cupy

    if not testing.on_sm90a():
        pytest.skip("the w8a8 kernels need sm_90a")
    mod = cupy.cuda.function.Module()
    mod.load(compile_checks())
    grid, block = (cupy.cuda.Device().attributes["MultiProcessorCount"] * 8,), (256,)
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
