// Shared device helpers for every cupymoe kernel: bf16 vectors, warp reductions,
// the activations of DESIGN.md section 1. Compiled by NVRTC (no host code here).
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned long long u64;

// NVRTC has no <cmath>: spell the special values with the device intrinsics.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

#define CUPYMOE_WARP 32
#define CUPYMOE_FULL_MASK 0xffffffffu

// Programmatic dependent launch (sm_90+; cupymoe/kernels.py launch_pdl): a kernel of the
// decode chain launched with it may start while the kernel before it in the stream still
// runs, so it waits here, at its top and in every block, until that kernel has finished
// and its writes are visible (a chain whose every kernel waits is ordered transitively),
// then lets the next kernel of the chain be scheduled: its blocks take the SMs this one's
// last blocks leave idle and wait in turn. Launched without the attribute both are no-ops.
__device__ __forceinline__ void pdl_wait_then_release_next() {
#if CUPYMOE_SM >= 90
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The wait alone, where a kernel releases no successor of its own (the stacked GEMMs' extra K
// read T by it: forward_plan.with_lora's prefill overlap).
__device__ __forceinline__ void pdl_wait() {
#if CUPYMOE_SM >= 90
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The release alone, at a kernel's top, before its own wait: only where the successor reads before
// its wait nothing but what this kernel's own launch already found complete (lora_gate_up_act,
// released by gate/up past gate/up's wait, lets down stream its first weights beside it; down reads
// the lists, done before gate/up's wait, and act only past its own wait for this grid).
__device__ __forceinline__ void pdl_release_early() {
#if CUPYMOE_SM >= 90
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A block that leaves before its wait (a decode block with no expert or columns to serve,
// whose weight copies went out before the wait): the grid's first block waits anyway, so the
// grid never completes before the kernel it follows. griddepcontrol.wait covers only the
// grid a kernel follows: were every block of a grid to leave early (a down launch of a
// format no chosen expert has, between gate/up and another format's down), the kernel after
// it could read what the kernels before it still write. Harmless after a wait.
__device__ __forceinline__ void pdl_leave_early() {
    if ((blockIdx.x | blockIdx.y | blockIdx.z) == 0) pdl_wait_then_release_next();
}

// Activation codes shared with cupymoe/kernels.py (ACTIVATION_CODES).
#define ACT_SILU 0
#define ACT_GELU 1
#define ACT_GELU_TANH 2
#define ACT_SWIGLU_OAI 3
// Not an activation: the LoRA plans' gate/up stores a row's g and u side by side, before the
// activation (rows 2 I_max wide: g at column c, u at I_max + c), so the adapters' deltas can be
// added to them (cuda/lora.cu) after one pass over the weights. Never passed to activation().
#define ACT_PAIR 4

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(CUPYMOE_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(CUPYMOE_FULL_MASK, v, o));
    return v;
}

// 8 bf16 in one 16-byte register quad.
struct bf16x8 {
    uint4 raw;
};

__device__ __forceinline__ bf16x8 load_bf16x8(const bf16* p) {
    bf16x8 v;
    v.raw = __ldg(reinterpret_cast<const uint4*>(p));
    return v;
}

// Weights are read exactly once per step: stream them past L1 (no allocation there).
__device__ __forceinline__ bf16x8 load_bf16x8_stream(const bf16* p) {
    bf16x8 v;
    const uint4* q = reinterpret_cast<const uint4*>(p);
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.raw.x), "=r"(v.raw.y), "=r"(v.raw.z), "=r"(v.raw.w)
                 : "l"(q));
    return v;
}

__device__ __forceinline__ void unpack_bf16x8(const bf16x8& v, float f[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v.raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

__device__ __forceinline__ float dot_bf16x8(const bf16x8& a, const float b[8], float acc) {
    float f[8];
    unpack_bf16x8(a, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(f[i], b[i], acc);
    return acc;
}

// The warp's inclusive scan of n at each lane.
__device__ __forceinline__ int warp_inclusive_scan(int n, int lane) {
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(CUPYMOE_FULL_MASK, incl, o);
        if (lane >= o) incl += t;
    }
    return incl;
}
// ... and the whole warp's sum in `total`.
__device__ __forceinline__ int warp_inclusive_scan(int n, int lane, int& total) {
    const int incl = warp_inclusive_scan(n, lane);
    total = __shfl_sync(CUPYMOE_FULL_MASK, incl, 31);
    return incl;
}

// Block-wide exclusive scan of one int per thread, for blocks of exactly 1024 threads (the
// expert-list and sort kernels); `tmp` is 33 ints of shared memory; `total` gets the sum.
__device__ __forceinline__ int block_exclusive_scan_1024(int v, int* tmp, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int incl = warp_inclusive_scan(v, lane);
    if (lane == 31) tmp[warp] = incl;
    __syncthreads();
    if (warp == 0) {  // the 32 warp totals, scanned by one warp
        const int t = tmp[lane];
        const int ti = warp_inclusive_scan(t, lane);
        tmp[lane] = ti - t;  // exclusive warp offsets
        if (lane == 31) tmp[32] = ti;
    }
    __syncthreads();
    total = tmp[32];
    const int r = tmp[warp] + incl - v;
    __syncthreads();
    return r;
}

// Stable places of a block's (row, slot) pairs within their experts' runs, pair i of the
// block on thread i (sort_place; build_expert_lists), in three steps with a barrier after
// each: `before` ([warps][n_local] 16-bit counts: a block has at most 1024 pairs) zeroed;
// warp_slot_rank, whose lanes of one slot find each other by one match, the lowest of them
// writing the warp's count of the slot; warps_exclusive_prefix for each slot, turning its
// column of warp counts into the counts of the warps before each. A pair's place among its
// expert's pairs of the block is then before[warp][slot] + its rank. `slot` < 0: nobody's
// pair (it matches no other lane and writes nothing). Every lane of the warp must call it.
__device__ __forceinline__ int warp_slot_rank(unsigned short* before, int n_local, int slot, int warp, int lane) {
    const int key = slot >= 0 ? slot : -1 - lane;
    const unsigned peers = __match_any_sync(CUPYMOE_FULL_MASK, key);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    if (slot >= 0 && rank == 0) before[warp * n_local + slot] = (unsigned short)__popc(peers);
    return rank;
}

// Slot i's column of `warps` warp counts (warp_slot_rank) becomes their exclusive running
// sums; returns the slot's pairs in the block. Eight loads in flight: the column is one
// slot's, walked by one thread. Its loops stay rolled: the list kernels run this code once
// a launch, so its length costs more than the latency unrolling would save.
__device__ __forceinline__ int warps_exclusive_prefix(unsigned short* before, int n_local, int warps, int i) {
    int run = 0, w = 0;
#pragma unroll 1
    for (; w + 8 <= warps; w += 8) {
        int c[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = before[(w + j) * n_local + i];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            before[(w + j) * n_local + i] = (unsigned short)run;
            run += c[j];
        }
    }
#pragma unroll 1
    for (; w < warps; ++w) {
        const int c = before[w * n_local + i];
        before[w * n_local + i] = (unsigned short)run;
        run += c;
    }
    return run;
}

// The sum of one float per thread over a block of THREADS threads, in warp order (the same
// bits every launch), returned to every thread; `partial` holds THREADS / 32 floats of
// shared memory. One call per `partial` between barriers.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* partial) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < THREADS / 32; ++i) t += partial[i];
    return t;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// act(g, u) of DESIGN.md section 1, for one activation ACT.
template <int ACT>
__device__ __forceinline__ float activation(float g, float u, float alpha, float limit) {
    if (ACT == ACT_GELU) return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    if (ACT == ACT_GELU_TANH) {
        const float c = 0.7978845608028654f;  // sqrt(2 / pi)
        return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * u;
    }
    if (ACT == ACT_SWIGLU_OAI) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return g * sigmoidf_(alpha * g) * (u + 1.0f);
    }
    return g * sigmoidf_(g) * u;  // ACT_SILU
}

// The same for a launch-uniform code `act`: one predictable branch per element. Where a
// kernel applies it to many elements in unrolled code, it switches once instead
// (with_activation) and runs activation<ACT>: every element's switch inlines every
// activation, and the code that runs becomes sparse in a large body that stalls on
// instruction fetch.
__device__ __forceinline__ float apply_activation(int act, float g, float u, float alpha, float limit) {
    switch (act) {
        case ACT_GELU:
            return activation<ACT_GELU>(g, u, alpha, limit);
        case ACT_GELU_TANH:
            return activation<ACT_GELU_TANH>(g, u, alpha, limit);
        case ACT_SWIGLU_OAI:
            return activation<ACT_SWIGLU_OAI>(g, u, alpha, limit);
        default:
            return activation<ACT_SILU>(g, u, alpha, limit);
    }
}

// The store of a gate/up epilogue whose code is a run-time value: column c of position pos's
// row (g, u with their scales and biases) as act(g, u) at out[pos I_max + c], or with ACT_PAIR
// g and u, each in bf16, at out[2 pos I_max + c] and I_max columns further.
__device__ __forceinline__ void store_gate_up(bf16* __restrict__ out, size_t pos, int c, int I_max, int act,
                                              float g, float u, float alpha, float limit) {
    if (act == ACT_PAIR) {
        bf16* o = out + pos * (2 * (size_t)I_max) + c;
        o[0] = __float2bfloat16(g);
        o[I_max] = __float2bfloat16(u);
        return;
    }
    out[pos * I_max + c] = __float2bfloat16(apply_activation(act, g, u, alpha, limit));
}

// Calls f(ActTag<ACT>{}) for the activation ACT that the launch-uniform code `act` names:
// one switch, then f's body as straight code for that activation (f reads ACT as
// decltype(tag)::value). PAIR: the caller's f also serves ACT_PAIR (a LoRA-capable gate/up
// epilogue); without it code ACT_PAIR runs the default, as the w8a8 kernels never get it.
template <int A>
struct ActTag {
    static constexpr int value = A;
};
template <bool PAIR = false, class F>
__device__ __forceinline__ void with_activation(int act, F&& f) {
    if constexpr (PAIR) {
        if (act == ACT_PAIR) {
            f(ActTag<ACT_PAIR>{});
            return;
        }
    }
    switch (act) {
        case ACT_GELU:
            f(ActTag<ACT_GELU>{});
            return;
        case ACT_GELU_TANH:
            f(ActTag<ACT_GELU_TANH>{});
            return;
        case ACT_SWIGLU_OAI:
            f(ActTag<ACT_SWIGLU_OAI>{});
            return;
        default:
            f(ActTag<ACT_SILU>{});
    }
}

// The reduce kernels' row prologue (decode_reduce, grouped_reduce: one block of THREADS
// threads per row). Puts the row's k slot positions (and, when `s_w` is given, their
// weights) in shared memory, so the loads of the k expert outputs that follow are
// independent; sums the weights of the zero (identity) experts the row chose into
// `zero_w` (primary rank only: they belong to no rank); returns the shared expert's scale,
// sigmoid(x[row] . shared_gate_w), or 1 without a gate. `hide_routed` (the atomic path,
// whose routed terms are already summed) stores -1 positions. Ends with a barrier.
struct RowPrologue {
    float shared_scale, zero_w;
    int shared_pos;  // the shared expert's output row of this token, -1 without one (or off rank 0)
};
template <int THREADS>
__device__ __forceinline__ RowPrologue reduce_row_prologue(int row, int N, int k, int E, int H, const int* __restrict__ pair_pos,
                                                     const int* __restrict__ ids, const float* __restrict__ topk_w,
                                                     const bf16* __restrict__ x, const float* __restrict__ shared_gate_w,
                                                     int has_shared, int primary, bool hide_routed, int* s_pos,
                                                     float* s_w) {
    __shared__ float partial[THREADS / 32];
    __shared__ float s_zero_w;
    if (threadIdx.x < 32) {
        float zw = 0.0f;
        for (int s = threadIdx.x; s < k; s += 32) {
            const int p = row * k + s;
            const int pos = pair_pos[p];
            s_pos[s] = hide_routed ? -1 : pos;
            if (s_w) s_w[s] = topk_w[p];
            if (pos < 0 && primary && ids[p] >= E) zw += topk_w[p];
        }
        zw = warp_sum(zw);
        if (threadIdx.x == 0) s_zero_w = zw;
    }
    float scale = 1.0f;
    if (has_shared && primary && shared_gate_w) {
        const size_t rbase = (size_t)row * H;
        float d = 0.0f;
        for (int h = threadIdx.x; h < H; h += THREADS) d = fmaf(__bfloat162float(x[rbase + h]), shared_gate_w[h], d);
        scale = sigmoidf_(block_sum<THREADS>(d, partial));
    }
    __syncthreads();
    return RowPrologue{scale, s_zero_w, has_shared && primary ? pair_pos[N * k + row] : -1};
}
