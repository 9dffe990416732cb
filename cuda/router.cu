// Router stage: fp32 router logits (bf16 weights) and the pre-expert RMSNorm.
//
// router_logits_bf16<ROWS>: logits[n, r] = x[n, :] . W[r, :] (+ bias[r]), fp32 accumulation.
// One warp per router column r streams W[r, :] once per ROWS-row tile; each lane owns a
// fixed 8-element slice pattern of H, so a row's logit has the same accumulation order
// whatever N or ROWS is (row invariance: a row's bits never depend on its batch).
#include "common.cuh"

#define ROUTER_WARPS 8

template <int ROWS>
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_logits_bf16(const bf16* __restrict__ x, const bf16* __restrict__ W, const float* __restrict__ bias,
                   float* __restrict__ logits, int N, int R, int H) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROUTER_WARPS + warp;
    if (r >= R) return;
    const int row0 = blockIdx.y * ROWS;
    const bf16* w = W + (size_t)r * H;
    float acc[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;

#pragma unroll 2
    for (int k = lane * 8; k < H; k += 256) {
        float wf[8];
        unpack_bf16x8(load_bf16x8_stream(w + k), wf);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int row = row0 + i;
            if (row < N) acc[i] = dot_bf16x8(load_bf16x8(x + (size_t)row * H + k), wf, acc[i]);
        }
    }
    const float b = bias ? bias[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const float v = warp_sum(acc[i]);
        const int row = row0 + i;
        if (lane == 0 && row < N) logits[(size_t)row * R + r] = v + b;
    }
}

// y[n, :] = bf16(x[n, :] * rsqrt(mean(x[n, :]^2) + eps) * w), one block per row.
#define NORM_THREADS 256
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_bf16(const bf16* __restrict__ x, const float* __restrict__ w, bf16* __restrict__ y, int H, float eps) {
    __shared__ float partial[NORM_THREADS / 32];
    const size_t base = (size_t)blockIdx.x * H;
    float ss = 0.0f;
    for (int h = threadIdx.x * 8; h < H; h += NORM_THREADS * 8) {
        float f[8];
        unpack_bf16x8(load_bf16x8(x + base + h), f);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; ++i) total += partial[i];
    const float inv = rsqrtf(total / (float)H + eps);
    for (int h = threadIdx.x * 8; h < H; h += NORM_THREADS * 8) {
        float f[8];
        unpack_bf16x8(load_bf16x8(x + base + h), f);
        __align__(16) bf16 o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16(f[i] * inv * w[h + i]);
        *reinterpret_cast<uint4*>(y + base + h) = *reinterpret_cast<const uint4*>(o);
    }
}
