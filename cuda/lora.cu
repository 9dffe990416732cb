// LoRA (DESIGN.md section 1, step 7; cupymoe/lora_slots.py owns the buffers): the router's
// delta, added to the logits between the router and the routing stage, so it can change the
// routing; the routed and shared experts' deltas, added per (row, expert) pair to the
// pre-activation g, u the LoRA plans' gate/up stores side by side (ACT_PAIR) and to the
// expert's output before the routing weight (DESIGN.md section 9).
#include "common.cuh"

#define LORA_THREADS 256
#define ERR_LORA_ID_RANGE 4  // routing.cuh: ERR_TOKEN_ID_RANGE 1, ERR_EXPERT_ID_RANGE 2

// The per-pair shrinks' partial sums: LORA_RC ranks a thread at once (registers), reduced over
// the block's warps through shared memory (LORA_RED floats) in a fixed order.
#define LORA_RC 16
#define LORA_RED (LORA_THREADS / 32 * LORA_RC)

// t[j0 + r] = scale * (the block's acc[r] summed) for r < LORA_RC, j0 + r < max_rank: each warp's
// sums by butterfly, then the warps' in warp order (a row's bits depend on its own data alone).
__device__ __forceinline__ void lora_reduce_ranks(float (&acc)[LORA_RC], float* red, float* t, int j0, int max_rank,
                                                  float scale) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < LORA_RC; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < LORA_RC; ++r) red[warp * LORA_RC + r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < LORA_RC && j0 + (int)threadIdx.x < max_rank) {
        float s = 0.f;
        for (int w = 0; w < warps; ++w) s += red[w * LORA_RC + threadIdx.x];
        t[j0 + threadIdx.x] = s * scale;
    }
    __syncthreads();  // red is reused by the next rank chunk
}

// One block a row: t = A[slot] x (the block's threads split H in 4-float vectors, LORA_RC ranks
// at a time), then logits[row] += Bs[slot] t. A [K, max_rank, H] and Bs = scale * B [K, R,
// max_rank] are fp32, zero past an adapter's rank (and all zero in an empty slot), so every slot
// runs the same loops. Rows with id -1 leave at once; an id >= K sets an error bit and adds
// nothing. A row's delta reads that row alone, so its bits depend on neither N nor the batch
// (row_invariant holds).
__global__ void __launch_bounds__(LORA_THREADS)
lora_router_delta(const bf16* __restrict__ x,       // [N, H]: the router's input
                  const int* __restrict__ lora_ids,  // [N]: -1 = base only
                  const float* __restrict__ a,       // [K, max_rank, H]
                  const float* __restrict__ bs,      // [K, R, max_rank]
                  float* __restrict__ logits,        // [N, R] (a split router's copy 0)
                  int* __restrict__ err, int N, int H, int R, int max_rank, int max_loras) {
    extern __shared__ float t[];  // [max_rank], then LORA_RED floats of partial sums
    const int row = blockIdx.x;
    if (row >= N) return;
    const int slot = lora_ids[row];
    if (slot < 0) return;
    if (slot >= max_loras) {
        if (threadIdx.x == 0) atomicOr(err, ERR_LORA_ID_RANGE);
        return;
    }
    const bf16* xr = x + (size_t)row * H;
    const float* as = a + (size_t)slot * max_rank * H;
    for (int j0 = 0; j0 < max_rank; j0 += LORA_RC) {
        float acc[LORA_RC] = {};
        for (int i = threadIdx.x * 4; i < H; i += blockDim.x * 4) {  // H is a multiple of 8
            const uint2 xv = __ldg(reinterpret_cast<const uint2*>(xr + i));
            const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv.x));
            const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xv.y));
#pragma unroll
            for (int r = 0; r < LORA_RC; ++r) {
                if (j0 + r >= max_rank) break;
                const float4 av = __ldg(reinterpret_cast<const float4*>(as + (size_t)(j0 + r) * H + i));
                acc[r] = fmaf(av.w, x23.y, fmaf(av.z, x23.x, fmaf(av.y, x01.y, fmaf(av.x, x01.x, acc[r]))));
            }
        }
        lora_reduce_ranks(acc, t + max_rank, t, j0, max_rank, 1.0f);
    }
    float* l = logits + (size_t)row * R;
    for (int e = threadIdx.x; e < R; e += blockDim.x) {
        const float* be = bs + ((size_t)slot * R + e) * max_rank;
        float d = 0.f;
        for (int j = 0; j < max_rank; ++j) d = fmaf(be[j], t[j], d);
        l[e] += d;
    }
}

// The expert deltas' per-pair geometry: pair q of N k routed pairs, then (has_shared) the shared
// expert's pair of each row at N k + row. pos: the pair's position in the sorted buffers (act,
// y, yw), -1 for an identity expert's or another rank's pair; slot: its table slot.
struct LoraPair {
    int pos, row, slot;
};
__device__ __forceinline__ LoraPair lora_pair(int q, int N, int k, const int* __restrict__ ids,
                                              const int* __restrict__ pair_pos, const int* __restrict__ slot_of,
                                              int n_local) {
    const int P = N * k;
    const int pos = pair_pos[q];
    if (pos < 0) return LoraPair{-1, 0, 0};
    return q < P ? LoraPair{pos, q / k, slot_of[ids[q]]} : LoraPair{pos, q - P, n_local};
}

// t[j] = scale * A[j, :len] . v for j < max_rank; A bf16 [max_rank, stride] (stride: the slot
// array's padded width, len: this expert's; both multiples of 8). The block's threads split len
// in 16-byte vectors (8 bf16 of v against 8 of each rank row), LORA_RC ranks at a time, fp32
// sums reduced over the warps (lora_reduce_ranks, red: LORA_RED floats).
__device__ __forceinline__ void lora_shrink(float* t, float* red, const bf16* __restrict__ a,
                                            const bf16* __restrict__ v, int len, int stride, int max_rank,
                                            float scale) {
    for (int j0 = 0; j0 < max_rank; j0 += LORA_RC) {
        float acc[LORA_RC] = {};
        for (int i = threadIdx.x * 8; i < len; i += blockDim.x * 8) {
            float vf[8];
            unpack_bf16x8(load_bf16x8(v + i), vf);
#pragma unroll
            for (int r = 0; r < LORA_RC; ++r) {
                if (j0 + r >= max_rank) break;
                acc[r] = dot_bf16x8(load_bf16x8(a + (size_t)(j0 + r) * stride + i), vf, acc[r]);
            }
        }
        lora_reduce_ranks(acc, red, t, j0, max_rank, scale);
    }
}

// B bf16 [out, max_rank] row c times t: the delta of output column c (16-byte loads of the rank
// row where max_rank is a multiple of 8; the sum in rank order either way).
__device__ __forceinline__ float lora_expand(const bf16* __restrict__ b, const float* t, int c, int max_rank) {
    const bf16* bc = b + (size_t)c * max_rank;
    float d = 0.f;
    int j = 0;
    if ((max_rank & 7) == 0) {
        for (; j < max_rank; j += 8) {
            float f[8];
            unpack_bf16x8(load_bf16x8(bc + j), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) d = fmaf(f[e], t[j + e], d);
        }
    }
    for (; j < max_rank; ++j) d = fmaf(__bfloat162float(bc[j]), t[j], d);
    return d;
}

// grid (N k + N has_shared), block LORA_THREADS, 2 max_rank + LORA_RED floats of shared memory.
// gu [positions, 2 I_max] holds the pair's g and u (bf16, stored in one pass by gate/up with
// ACT_PAIR: g at column c, u at I_max + c); this adds each adapter's gate / up delta (rows with
// an adapter) and writes act = act(g, u) in bf16 for every pair the gate/up stored, with or
// without an adapter. Slots: A [K, S, max_rank, H], B [K, S, I_max, max_rank] bf16 (S =
// n_local + 1 table slots), scale [K, S, 3] fp32 (gate, up, down); zeros past an adapter's
// rank and for modules it does not name. A pair reads its own row only (row_invariant holds).
__global__ void __launch_bounds__(LORA_THREADS)
lora_gate_up_act(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ lora_ids,
                 const int* __restrict__ ids, const int* __restrict__ pair_pos, const int* __restrict__ slot_of,
                 const int* __restrict__ inter, const bf16* __restrict__ gate_a, const bf16* __restrict__ gate_b,
                 const bf16* __restrict__ up_a, const bf16* __restrict__ up_b, const float* __restrict__ scale,
                 const bf16* __restrict__ gu, bf16* __restrict__ act, int N, int k, int H, int I_max,
                 int n_local, int max_rank, int max_loras, int act_code, float alpha, float limit) {
    extern __shared__ float t[];  // [2 max_rank]: gate's, then up's; then LORA_RED partial sums
    const LoraPair pr = lora_pair(blockIdx.x, N, k, ids, pair_pos, slot_of, n_local);
    if (pr.pos < 0) return;
    const int I = inter[pr.slot];
    const int lid = lora_ids[pr.row];
    const bool on = lid >= 0 && lid < max_loras;  // an id >= K was flagged by lora_router_delta
    const size_t ks = on ? (size_t)lid * (n_local + 1) + pr.slot : 0;
    if (on) {
        const bf16* in = (pr.slot == n_local ? x : xe) + (size_t)pr.row * H;  // the shared expert reads x
        float* red = t + 2 * max_rank;
        lora_shrink(t, red, gate_a + ks * max_rank * H, in, H, H, max_rank, scale[ks * 3]);
        lora_shrink(t + max_rank, red, up_a + ks * max_rank * H, in, H, H, max_rank, scale[ks * 3 + 1]);
    }
    __syncthreads();
    const bf16* gr = gu + (size_t)pr.pos * 2 * I_max;  // g, then u at I_max
    bf16* ar = act + (size_t)pr.pos * I_max;
    for (int c = threadIdx.x; c < I; c += blockDim.x) {
        float g = __bfloat162float(gr[c]), u = __bfloat162float(gr[I_max + c]);
        if (on) {
            g += lora_expand(gate_b + ks * I_max * max_rank, t, c, max_rank);
            u += lora_expand(up_b + ks * I_max * max_rank, t + max_rank, c, max_rank);
        }
        ar[c] = __float2bfloat16(apply_activation(act_code, g, u, alpha, limit));
    }
}

#define LORA_DOWN_DECODE 0   // y [pos, H] fp32, unweighted (decode_reduce weights it)
#define LORA_DOWN_ATOMIC 1   // routed pairs: acc [row, H] += w d; the shared expert's y as decode
#define LORA_DOWN_GROUPED 2  // yw [pos, H] bf16, weighted: yw = bf16(yw + w d)

// grid (N k + N has_shared), block LORA_THREADS, max_rank + LORA_RED floats of shared memory. The down
// delta of each pair with an adapter: t = s A act[pos], d = B t, added to the expert's output
// before the routing weight multiplies (mode: where the path keeps that output).
// A [K, S, max_rank, I_max], B [K, S, H, max_rank] bf16.
__global__ void __launch_bounds__(LORA_THREADS)
lora_down_delta(const bf16* __restrict__ act, const int* __restrict__ lora_ids, const int* __restrict__ ids,
                const int* __restrict__ pair_pos, const int* __restrict__ slot_of, const int* __restrict__ inter,
                const bf16* __restrict__ down_a, const bf16* __restrict__ down_b, const float* __restrict__ scale,
                const float* __restrict__ topk_w, float* __restrict__ y, float* __restrict__ acc,
                bf16* __restrict__ yw, int N, int k, int H, int I_max, int n_local, int max_rank, int max_loras,
                int mode) {
    extern __shared__ float t[];  // [max_rank], then LORA_RED partial sums
    const LoraPair pr = lora_pair(blockIdx.x, N, k, ids, pair_pos, slot_of, n_local);
    if (pr.pos < 0) return;
    const int lid = lora_ids[pr.row];
    if (lid < 0 || lid >= max_loras) return;
    const size_t ks = (size_t)lid * (n_local + 1) + pr.slot;
    lora_shrink(t, t + max_rank, down_a + ks * max_rank * I_max, act + (size_t)pr.pos * I_max, inter[pr.slot], I_max, max_rank,
                scale[ks * 3 + 2]);
    __syncthreads();
    const bool routed = (int)blockIdx.x < N * k;
    const float w = routed ? topk_w[blockIdx.x] : 1.0f;  // the shared expert is scaled in the reduce
    const bf16* b = down_b + ks * H * max_rank;
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        const float d = lora_expand(b, t, h, max_rank);
        const size_t o = (size_t)pr.pos * H + h;
        if (mode == LORA_DOWN_GROUPED)
            yw[o] = __float2bfloat16(__bfloat162float(yw[o]) + w * d);
        else if (mode == LORA_DOWN_ATOMIC && routed)
            atomicAdd(acc + (size_t)pr.row * H + h, w * d);
        else
            y[o] += d;
    }
}
