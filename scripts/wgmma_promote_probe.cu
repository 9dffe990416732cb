// Kernels of scripts/wgmma_promote_probe.py: how much of the SM's e4m3 tensor rate the w8a8 main
// loop's promotion schedules leave, with one or two consumer warpgroups an SM, operands resident in
// shared memory (no copies, no barriers: the issue side alone). The question it answers: can one
// warpgroup keep the tensor cores busy while the block's other warpgroup runs an epilogue (a
// ping-pong schedule), or does its own promotion leave them idle?
//
//   SCHED_HALVES    grouped_sm90_fp8_tma.cu's loop: a 128-code step as two halves of 128 weight rows,
//                   each four m64n128k32 wgmmas into one block accumulator, waited for, then promoted
//                   (fp8_gemm.cuh's own functions)
//   SCHED_QUARTERS  four quarters of 64 weight rows, each four m64n64k32 wgmmas into one of two block
//                   accumulators: quarter q + 1's wgmmas go out before quarter q is promoted, across
//                   steps too (128 + 64 accumulator registers)
//   SCHED_BARE      the halves' wgmmas and waits without the promotion
//
// PARTNER: warpgroup 1 runs no wgmmas but the gate/up epilogue's arithmetic (silu_rn_nearest and a
// quotient an element, fp8_gemm.cuh) until warpgroup 0 is done, as a ping-pong's other warpgroup would.
// Each block writes its warpgroup 0's clock64 cycles a step into cycles[blockIdx.x] and the loop's
// %globaltimer nanoseconds into nanos[blockIdx.x]; the sink's store (never taken) keeps the
// accumulators alive.
#include "fp8_gemm.cuh"

#define SCHED_HALVES 0
#define SCHED_QUARTERS 1
#define SCHED_BARE 2
#define PROBE_STAGES 4   // stages cycled through, as the kernel's ring
#define PROBE_BN 256     // weight rows a stage
#define PROBE_BK 128     // codes a stage row

// One quarter's products: four m64n64k32 wgmmas into blk (fresh at the first), committed, not waited.
__device__ __forceinline__ void quarter_products(float* blk, u64 da, u64 db) {
    fence_acc<32>(blk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64nNk32_e4m3<64>(blk, da + kk * 2, db + kk * 2, kk);
    wgmma_commit();
}

// fp8_promote's arithmetic on a quarter's 32 accumulators (rows h = 0, 1 of the thread's fragment)
__device__ __forceinline__ void promote_quarter(float* acc, float* blk, const float (&a)[2], float s) {
    fence_acc<32>(blk);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sc = a[h] * s;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[j * 4 + h * 2] = fmaf(blk[j * 4 + h * 2], sc, acc[j * 4 + h * 2]);
            acc[j * 4 + h * 2 + 1] = fmaf(blk[j * 4 + h * 2 + 1], sc, acc[j * 4 + h * 2 + 1]);
        }
    }
}

template <int SCHED>
__device__ __forceinline__ float main_loop(const u8* sA, const u8* sB, int steps, const float* scales) {
    constexpr int BK = PROBE_BK, BN = PROBE_BN;
    const float a[2] = {scales[threadIdx.x & 7], scales[8 + (threadIdx.x & 7)]};
    float sum = 0.0f;
    if (SCHED == SCHED_QUARTERS) {
        float acc[4][32], blk[2][32];  // blk: fresh at each quarter's first wgmma, no zeros needed
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[0][i] = acc[1][i] = acc[2][i] = acc[3][i] = 0.0f;
        steps = __shfl_sync(0xffffffffu, steps, 0);  // warp-uniform as ptxas sees it, or it serializes the wgmmas
        auto db = [&](int k, int q) { return wgmma_desc(sB + ((k % PROBE_STAGES) * BN + q * 64) * BK); };
        auto da = [&](int k) { return wgmma_desc(sA + (k % PROBE_STAGES) * 64 * BK); };
        quarter_products(blk[0], da(0), db(0, 0));
        int k = 0;
        do {  // steps >= 1
            const float s = scales[16 + (k & 15)];
            quarter_products(blk[1], da(k), db(k, 1));
            wgmma_wait<1>();
            promote_quarter(acc[0], blk[0], a, s);
            quarter_products(blk[0], da(k), db(k, 2));
            wgmma_wait<1>();
            promote_quarter(acc[1], blk[1], a, s);
            quarter_products(blk[1], da(k), db(k, 3));
            wgmma_wait<1>();
            promote_quarter(acc[2], blk[0], a, s);
            if (k + 1 < steps) {
                quarter_products(blk[0], da(k + 1), db(k + 1, 0));
                wgmma_wait<1>();
            } else {
                wgmma_wait<0>();
            }
            promote_quarter(acc[3], blk[1], a, s);
        } while (++k < steps);
#pragma unroll
        for (int i = 0; i < 32; ++i) sum += acc[0][i] + acc[1][i] + acc[2][i] + acc[3][i];
    } else {
        float acc[2][64], blk[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[0][i] = acc[1][i] = blk[i] = 0.0f;
        for (int k = 0; k < steps; ++k) {
            const int s = k % PROBE_STAGES;
            const float s0 = scales[16 + (k & 15)], s1 = scales[32 + (k & 15)];
            const u64 da = wgmma_desc(sA + s * 64 * BK);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                fp8_block_products(blk, da, wgmma_desc(sB + (s * BN + half * 128) * BK));
                if (SCHED == SCHED_HALVES) fp8_promote<true>(acc[half], blk, a, s0, s1);
            }
        }
#pragma unroll
        for (int i = 0; i < 64; ++i) sum += acc[0][i] + acc[1][i] + blk[i];
    }
    return sum;
}

// The gate/up epilogue's per-element arithmetic on 64 values a thread, repeated until *done.
__device__ __forceinline__ float epilogue_work(const float* scales, volatile int* done) {
    float v[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) v[i] = scales[i & 63] * (float)(i + 1) - 3.0f;
    float m = 0.0f;
    int rounds = 0;
    while (!*done) {
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = silu_rn_nearest(v[i], v[i + 32]);
#pragma unroll
        for (int i = 0; i < 64; ++i) m = fmaxf(m, fabsf(v[i]));
        const float sc = m / 448.0f, binv = 1.0f / sc;
#pragma unroll
        for (int i = 32; i < 64; ++i) v[i] = div_rn_nearest(v[i - 32], sc, binv) + 0.5f;
        ++rounds;
    }
    return m + (float)rounds;
}

// grid: one block an SM; block 128 (one warpgroup) or 256 (two); dynamic smem PROBE_STAGES x (64 x
// warpgroups + 256) x 128 bytes + 1 KB for alignment. scales: 48 floats.
template <int SCHED, int WGS, bool PARTNER>
__global__ void __launch_bounds__(128 * WGS, 1)
wgmma_promote_probe(int steps, const float* __restrict__ scales, long long* cycles, long long* nanos, float* sink) {
    static_assert(WGS == 1 || WGS == 2, "one or two warpgroups");
    static_assert(!PARTNER || WGS == 2, "the partner is warpgroup 1");
    constexpr int BK = PROBE_BK, BN = PROBE_BN;
    extern __shared__ __align__(1024) unsigned char probe_smem[];
    __shared__ int done;
    const unsigned pad = (1024u - (smem_u32(probe_smem) & 1023u)) & 1023u;
    u8* sB = probe_smem + pad;
    u8* sA = sB + PROBE_STAGES * BN * BK;  // warpgroup wg's A: 64 rows a stage after the other's
    const int a_bytes = PROBE_STAGES * 64 * BK * WGS;
    for (int i = threadIdx.x; i < (PROBE_STAGES * BN * BK + a_bytes) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(sB)[i] = 0x38383838u;  // e4m3 1.0 everywhere: finite products
    if (threadIdx.x == 0) done = 0;
    __syncthreads();
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);  // warp-uniform to ptxas (as steps)
    float r;
    if (PARTNER && wg == 1) {
        r = epilogue_work(scales, &done);
    } else {
        unsigned long long g0, g1;  // wall time too: a cross-check of the cycle counts against the known rate
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
        const long long t0 = clock64();
        r = main_loop<SCHED>(sA + wg * PROBE_STAGES * 64 * BK, sB, steps, scales);
        const long long t1 = clock64();
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
        if (threadIdx.x == 0) {
            cycles[blockIdx.x] = (t1 - t0) / steps;
            nanos[blockIdx.x] = (long long)(g1 - g0);
            if (PARTNER) *reinterpret_cast<volatile int*>(&done) = 1;
        }
    }
    if (r == 12345.678f) sink[threadIdx.x] = r;
}
