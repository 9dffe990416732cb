// What the w8a8 decode kernels share (fp8-block experts on their e4m3 codes, sm_89+):
// decode_mma.cu's mma.sync kernels and decode_wgmma_a8.cu's wgmma ones take the same
// arguments (the layer launches either with one tuple) and quantize the activation they
// write the same way.
#pragma once
#include "decode_common.cuh"
#include "quant.cuh"

#if CUPYMOE_SM >= 89
// The w8a8 kernels' arguments beyond the decode ones: x's codes and group scales (the
// routed experts' input: the norm's output's where there is a pre-expert norm), those of x
// for the shared expert (the same buffers unless that norm makes them differ), and the
// activation's codes [positions, I_max] and scales [positions, ceil(I_max / 128)];
// gate/up's `act_tickets` [max_active, ceil(I_max / 128)] (zeros between launches), and
// `slot_active` (the lists' slot -> active index) where the wgmma gate/up's grid is by table
// slot (null: by active index, as every other decode kernel's; decode_mma.cu's ignore it).
#define DECODE_A8_GATE_UP_ARGS                                                                              \
    DECODE_GATE_UP_ARGS, const u8 *__restrict__ qx, const float *__restrict__ sx,                           \
        const u8 *__restrict__ qx_shared, const float *__restrict__ sx_shared, u8 *__restrict__ qact,      \
        float *__restrict__ sact, int *__restrict__ act_tickets, const int *__restrict__ slot_active
#define DECODE_A8_DOWN_ARGS DECODE_DOWN_ARGS, const u8 *__restrict__ qact, const float *__restrict__ sact

// The activation's quantization, in the kernel that produces it: a 128-column group of an
// expert's activation is written by up to KS blocks (a block holds 128 / KS columns), so
// the last of them to finish (a ticket counter per expert and group, which it resets for
// the next launch) quantizes the group for every position of the expert, from the bf16
// values stored (as the w8a8 GEMM's epilogue does: grouped_sm90_fp8.cu).
__device__ __forceinline__ void quantize_act_group_if_last(const bf16* act, u8* __restrict__ qact,
                                                           float* __restrict__ sact, int* __restrict__ tickets,
                                                           int j, int col0, int cols_per_block, int I, int I_max,
                                                           int start, int len) {
    __shared__ int last;
    const int G = col0 >> 7, KB = (I_max + 127) >> 7;
    __threadfence();  // this block's activation stores, before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        const int blocks = (min(128, I - 128 * G) + cols_per_block - 1) / cols_per_block;
        int* t = tickets + j * KB + G;
        last = atomicAdd(t, 1) == blocks - 1;
        if (last) *t = 0;  // every block of the group has taken its ticket
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col = 128 * G + 4 * lane;
    for (int r = warp; r < len; r += blockDim.x >> 5) {
        const size_t at = (size_t)(start + r) * I_max + col;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (col < I) {  // written by other blocks: read through L2 (ld.global.cg), not the nc path
            const uint2 u = __ldcg(reinterpret_cast<const uint2*>(act + at));
            v[0] = __uint_as_float(u.x << 16);
            v[1] = __uint_as_float(u.x & 0xFFFF0000u);
            v[2] = __uint_as_float(u.y << 16);
            v[3] = __uint_as_float(u.y & 0xFFFF0000u);
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(CUPYMOE_FULL_MASK, amax, o));
        const float sc = amax / 448.0f;
        if (col < I)
            *reinterpret_cast<unsigned*>(qact + at) =
                e4m3x2_quantize(v[0], v[1], sc) | (e4m3x2_quantize(v[2], v[3], sc) << 16);
        if (lane == 0) sact[(size_t)(start + r) * KB + G] = sc;
    }
}
#endif
