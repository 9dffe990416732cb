// What the w8a8 grouped GEMMs share (grouped_sm90_fp8.cu: every thread copies by cp.async;
// grouped_sm90_fp8_tma.cu: TMA and a producer warpgroup): one 128-code K block's products and
// their fp32 promotion, and the gate/up epilogue's activation and e4m3 quantization. Both
// kernels run these same instructions per element, so their outputs agree bit for bit.
#pragma once
#include "gemm_common.cuh"
#include "wgmma.cuh"

// One 128-code K block's products of a warpgroup's 64 rows and 128 weight rows: four k32
// wgmmas into blk, the first starting it fresh, waited for (blk is then promoted).
__device__ __forceinline__ void fp8_block_products(float* blk, u64 da, u64 db) {
    fence_acc(blk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64nNk32_e4m3<128>(blk, da + kk * 2, db + kk * 2, kk);  // +32 bytes
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(blk);
}

// The promotion every 128 products, on the CUDA cores in fp32: acc += blk * s_a[row] * s_w,
// a[h] the activation scale of the thread's row h, s0 the weight block's scale (gate/up: the
// gate columns', j < 8; s1 the up columns', j >= 8). DeepSeek-V3's answer to the limited
// accumulation precision of Hopper's fp8 tensor cores.
template <bool GATE_UP>
__device__ __forceinline__ void fp8_promote(float* acc, const float* blk, const float (&a)[2], float s0, float s1) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const float sc = a[h] * (GATE_UP && j >= 8 ? s1 : s0);
            acc[j * 4 + h * 2] = fmaf(blk[j * 4 + h * 2], sc, acc[j * 4 + h * 2]);
            acc[j * 4 + h * 2 + 1] = fmaf(blk[j * 4 + h * 2 + 1], sc, acc[j * 4 + h * 2 + 1]);
        }
    }
}

// 1 / y as rcp.rn.f32 rounds it, without rcp.rn's slow-path branch (the SiLU's sigmoid: a branch an
// element kept the epilogue's elements from interleaving), for 1 <= y <= 2^125 (1 / y a normal float,
// which rcp.approx.ftz keeps). q = rcp.approx(y) lies within 1 ulp of 1 / y (PTX's bound), so one Newton
// step q + q (1 - y q) by fmas is 1 / y rounded (Markstein) but where y's significand is all ones, whose
// 1 / y rounded is 2^-(e+1) (1 + 2^-23), taken in closed form (two fmas, where choosing the least remainder
// among q and its neighbours takes six).
// tests/test_fp8_epilogue.py checks the rule against division, tests/test_gpu_fp8_epilogue.py every y.
__device__ __forceinline__ float rcp_rn_nearest(float y) {
    float q;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(q) : "f"(y));
    const int yb = __float_as_int(y);
    const float step = fmaf(fmaf(-y, q, 1.0f), q, q);
    return (yb & 0x7FFFFF) == 0x7FFFFF ? __int_as_float(0x7E800001 - (yb & 0x7F800000)) : step;
}

// activation<ACT_SILU>'s g * sigmoidf_(g) * u, the same bits, its 1 / y by rcp_rn_nearest: for g > -80
// (then 1 + e^-g < 2^125)
__device__ __forceinline__ float silu_rn_nearest(float g, float u) { return g * rcp_rn_nearest(1.0f + expf(-g)) * u; }

// The gate/up epilogue's first part for one warpgroup accumulator d: rows row0 + 16 warp + g
// + 8 h of the tile, gate columns 8 j + 2 t4 + e (j < 8) and the same up columns (j >= 8) of
// activation columns tw.n0 + .. . Each activation is rounded to bf16 (and, with STORE_ACT, stored
// into `out`, so that verify.W8a8Stages can read it: MoeLayer(keep_w8a8_activation=True)); the
// rounded values replace d's gate slots for fp8_quantize_act, and m[h] is the |max| of row h's 64
// columns (the quad's; columns past the matrix stay out). Slot i < 32 holds a gate column, slot
// i + 32 its up column.
template <int ACT, bool STORE_ACT>
__device__ __forceinline__ void fp8_gate_up_act(const GemmTile& tw, float* d, int row0, float (&m)[2], GEMM_ARGS) {
    const FragRows fr(row0, tw.rows);
    // the slot's bias pointers read once, not again for every column pair behind the stores
    const float* bg = reinterpret_cast<const float*>(b0_ptrs[tw.slot]);
    const float* bu = reinterpret_cast<const float*>(b1_ptrs[tw.slot]);
    // gate_up_scaled's arithmetic, in its order: g and u of gate slots i, i + 1 (up slots i + 32, i + 33)
    const auto gate_up = [&](int i, int col, float& g0, float& g1, float& u0, float& u1) {
        g0 = d[i] * tw.g0, g1 = d[i + 1] * tw.g0;
        u0 = d[i + 32] * tw.g1, u1 = d[i + 33] * tw.g1;
        if (bg) {
            g0 += __ldg(bg + col);
            g1 += __ldg(bg + col + 1);
        }
        if (bu) {
            u0 += __ldg(bu + col);
            u1 += __ldg(bu + col + 1);
        }
    };
    if (ACT == ACT_SILU) {
        // every g and u first (columns past the matrix: 0), so that one test of all the thread's g
        // picks the branch-free path
        bool fast = true;  // every g > -80: 1 + e^-g < 2^125, in rcp_rn_nearest's range (a NaN g fails it)
#pragma unroll
        for (int i = 0; i < 32; i += 2) {
            const int col = tw.n0 + (i >> 2) * 8 + 2 * fr.t4;
            float g0 = 0.0f, g1 = 0.0f, u0 = 0.0f, u1 = 0.0f;
            if (col < tw.ncols) gate_up(i, col, g0, g1, u0, u1);
            d[i] = g0, d[i + 1] = g1, d[i + 32] = u0, d[i + 33] = u1;
            fast = fast && g0 > -80.0f && g1 > -80.0f;
        }
        // the activations into the gate slots (g = u = 0 gives +0, as a column past the matrix needs):
        // one branch a thread, not one an element
        if (fast) {
#pragma unroll
            for (int i = 0; i < 32; ++i) d[i] = silu_rn_nearest(d[i], d[i + 32]);
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) d[i] = activation<ACT>(d[i], d[i + 32], alpha, limit);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = fr.r + 8 * h;
        bf16* const row = reinterpret_cast<bf16*>(out) + (size_t)(tw.pos0 + r) * I_max + tw.n0;
        float mh = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int i = j * 4 + h * 2, c = j * 8 + 2 * fr.t4, col = tw.n0 + c;
            float2 a = make_float2(d[i], d[i + 1]);  // the SiLU's, above
            if (ACT != ACT_SILU) {
                a = make_float2(0.0f, 0.0f);
                if (col < tw.ncols) {
                    float g0, g1, u0, u1;
                    gate_up(i, col, g0, g1, u0, u1);
                    a = make_float2(activation<ACT>(g0, u0, alpha, limit), activation<ACT>(g1, u1, alpha, limit));
                }
            }
            const __nv_bfloat162 b = __floats2bfloat162_rn(a.x, a.y);
            if (STORE_ACT && r < tw.rows && col < tw.ncols) *reinterpret_cast<__nv_bfloat162*>(row + c) = b;
            d[i] = __low2float(b);
            d[i + 1] = __high2float(b);
            mh = fmaxf(mh, fmaxf(fabsf(d[i]), fabsf(d[i + 1])));
        }
        mh = fmaxf(mh, __shfl_xor_sync(CUPYMOE_FULL_MASK, mh, 1));  // the quad holds the row's 64 columns
        m[h] = fmaxf(mh, __shfl_xor_sync(CUPYMOE_FULL_MASK, mh, 2));
    }
}

// a / b as div.rn.f32 rounds it, without div.rn's slow-path branch (a branch an element kept the
// epilogue's elements from interleaving), given binv = 1 / b rounded and b >= 2^-90. q = a binv lies
// within 1.5 ulps of a / b; one correction q + binv (a - b q) by fmas rounds it (Markstein's step; q may be
// 1.5 ulps off and the remainder subnormal: tests/test_fp8_epilogue.py checks every a of a binade on the
// worst b, tests/test_gpu_fp8_epilogue.py every a on the hardware).
// Quotients with |q| under 2^-11 are q itself: under 2^-10 the e4m3 code is a signed zero either way.
__device__ __forceinline__ float div_rn_nearest(float a, float b, float binv) {
    const float q = a * binv;
    const float best = fmaf(fmaf(-b, q, a), binv, q);
    return fabsf(q) < 0x1p-11f ? q : best;
}

// The second part: row h's scale amax[h] / 448 (amax over its 128-column group), its e4m3
// codes into qact [P, I_max] and, where write_scale, the scale into sact [P, ceil(I_max / 128)]
// (one thread a row). The codes are e4m3x2_quantize's, bit for bit: a row whose scale is at least
// 2^-90 (every row but those of near-zero activations) divides by div_rn_nearest.
__device__ __forceinline__ void fp8_quantize_act(const GemmTile& tw, const float* d, int row0, const float (&amax)[2],
                                                 bool write_scale, u8* __restrict__ qact, float* __restrict__ sact,
                                                 int I_max) {
    const FragRows fr(row0, tw.rows);
    const int KB = (I_max + 127) >> 7;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!fr.ok[h]) continue;
        const float sc = amax[h] / 448.0f;
        const size_t pos = tw.pos0 + fr.r + 8 * h;
        u8* q = qact + pos * I_max + tw.n0 + 2 * fr.t4;
        const int cols = tw.ncols - tw.n0 - 2 * fr.t4;  // the row's columns from q on
        if (sc >= 0x1p-90f) {
            const float binv = 1.0f / sc;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                // the upper byte's quotient first, the order cvt takes them in
                const float tb = div_rn_nearest(d[j * 4 + h * 2 + 1], sc, binv);
                const unsigned short p = e4m3x2_codes(div_rn_nearest(d[j * 4 + h * 2], sc, binv), tb);
                if (j * 8 < cols) *reinterpret_cast<unsigned short*>(q + j * 8) = p;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (j * 8 < cols)
                    *reinterpret_cast<unsigned short*>(q + j * 8) =
                        (unsigned short)e4m3x2_quantize(d[j * 4 + h * 2], d[j * 4 + h * 2 + 1], sc);
        }
        if (write_scale && fr.t4 == 0) sact[pos * KB + (tw.n0 >> 7)] = sc;
    }
}
