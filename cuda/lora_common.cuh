// What the LoRA kernels (lora.cu) share with the launches that fold the router's delta in at the
// decode chain's fewest rows (router.cu's router_logits_bf16_lora, decode.cu's
// decode_route_lists_lora): the shrink of one slice, the router's expand of one logit, their constants.
#pragma once
#include "common.cuh"

#define LORA_THREADS 256
#define ERR_LORA_ID_RANGE 4  // routing.cuh: ERR_TOKEN_ID_RANGE 1, ERR_EXPERT_ID_RANGE 2

// A row's adapter slot that is neither -1 (the base layer) nor a slot: flagged, the row gets no delta.
__device__ __forceinline__ bool lora_id_invalid(int id, int max_loras) { return id < -1 || id >= max_loras; }

// The per-pair kernels split each pair's (or row's) shrink over gridDim.y blocks (slices of the
// input columns, whole 8-column vectors): a block's threads take a rank row LORA_TPR at a time
// (16-byte vectors of A against the slice's vectors of the input, which each thread loads once),
// the LORA_TPR lanes' sums met by a fixed butterfly. With one slice the block has t at once; with
// more, each block stores its rank sums in lora_part [pair][slice][NP max_rank] and takes a ticket
// (lora_tickets [pair], zeros between forwards); the last block of the pair sums the slices in
// slice order (a row's bits never depend on which block came last), resets the ticket and runs
// the expand. Shared memory: LORA_RED + NP max_rank floats.
#define LORA_TPR 8
#define LORA_VPT 4  // vectors a lane of a rank row loads at once
#define LORA_RED 8  // floats past t: the last-block flag
// The folded router delta's slices at most (router_logits_bf16_lora's shares, each of whose
// loads decode_route_lists_lora issues at once): forward_plan.lora_fold_slices
#define LORA_FOLD_SLICES 16

// The block's rank sums of slice [lo, hi) of the input v (8-column vectors): red[rr] = A_p[j,
// lo:hi] . v[lo:hi] for rank row rr = p max_rank + j of NP projections (a0, a1: [max_rank,
// stride], bf16, or fp32 as AF32). A rank row goes to TPR lanes, each taking the slice's
// vectors l, l + TPR, ... (VPT a step, loads in flight together; v's vectors hit L1 after the
// first rank row), their sums met by a fixed butterfly.
template <int NP, bool AF32, int TPR = LORA_TPR, int VPT = LORA_VPT>
__device__ __forceinline__ void lora_slice_shrink(float* red, const void* a0, const void* a1,
                                                  const bf16* __restrict__ v, int lo, int hi, int stride,
                                                  int max_rank) {
    const int l = threadIdx.x & (TPR - 1);
    const int rows = NP * max_rank;
    for (int rr = threadIdx.x / TPR; rr < rows; rr += blockDim.x / TPR) {
        const int p = NP > 1 && rr >= max_rank, j = rr - p * max_rank;
        float acc = 0.f;
        for (int c0 = lo + 8 * l; c0 < hi; c0 += 8 * TPR * VPT) {
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int c = c0 + 8 * TPR * i;
                if (c >= hi) continue;
                float vf[8];
                unpack_bf16x8(load_bf16x8(v + c), vf);
                if (AF32) {
                    const float* ar = static_cast<const float*>(p ? a1 : a0) + (size_t)j * stride + c;
                    const float4 u = __ldg(reinterpret_cast<const float4*>(ar));
                    const float4 w = __ldg(reinterpret_cast<const float4*>(ar + 4));
                    acc = fmaf(u.x, vf[0], acc), acc = fmaf(u.y, vf[1], acc);
                    acc = fmaf(u.z, vf[2], acc), acc = fmaf(u.w, vf[3], acc);
                    acc = fmaf(w.x, vf[4], acc), acc = fmaf(w.y, vf[5], acc);
                    acc = fmaf(w.z, vf[6], acc), acc = fmaf(w.w, vf[7], acc);
                } else {
                    const bf16* ar = static_cast<const bf16*>(p ? a1 : a0) + (size_t)j * stride + c;
                    acc = dot_bf16x8(load_bf16x8(ar), vf, acc);
                }
            }
        }
        const unsigned group = ((1u << TPR) - 1u) << (threadIdx.x & 31 & ~(TPR - 1));  // the rank row's lanes
#pragma unroll
        for (int m = TPR / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(group, acc, m);
        if (l == 0) red[rr] = acc;
    }
}

// Slice s of S of len columns (whole 8-column vectors, as even as they go): [lo, hi).
__device__ __forceinline__ void lora_slice(int len, int s, int S, int& lo, int& hi) {
    const int vecs = (len + 7) >> 3, per = (vecs + S - 1) / S;
    lo = min(len, 8 * per * s);
    hi = min(len, 8 * per * (s + 1));
}

// Bs[slot] row e (fp32, max_rank) times t: the router delta of logit e, ranks in order.
__device__ __forceinline__ float lora_router_dot(const float* __restrict__ be, const float* t, int max_rank) {
    float d = 0.f;
    for (int j = 0; j < max_rank; ++j) d = fmaf(be[j], t[j], d);
    return d;
}
