// What the decode kernels share (decode.cu: CUDA-core streams of every format;
// decode_mma.cu: fp4 and fp8 weights on tensor cores): the block size, the kernels' argument
// lists, the active-expert lookup, and the expert lists' construction.
#pragma once
#include "common.cuh"

#define DECODE_WARPS 8
#define LISTS_THREADS 1024

// The decode expert kernels' argument lists: the layer launches the CUDA-core and the
// tensor-core kernels of a stage with one argument tuple, so they share one list.
// gate/up: x (the shared expert's input) and xe (the routed experts'), the active lists,
// per-slot weight / scale / global-scale / bias tables, each slot's format and width, and
// act [positions, I_max] out. down: act in, the same tables, the routing weights, and y
// [positions, H] (or, atomic, acc [rows, H]) out.
#define DECODE_GATE_UP_ARGS                                                                                     \
    const bf16 *__restrict__ x, const bf16 *__restrict__ xe, const int *__restrict__ num_active,                \
        const int *__restrict__ active_slot, const int *__restrict__ active_start,                              \
        const int *__restrict__ active_len, const int *__restrict__ sorted_row, const u64 *__restrict__ gate_ptrs, \
        const u64 *__restrict__ up_ptrs, const u64 *__restrict__ gate_scale_ptrs,                               \
        const u64 *__restrict__ up_scale_ptrs, const float *__restrict__ gate_gscale,                           \
        const float *__restrict__ up_gscale, const int *__restrict__ slot_fmt,                                  \
        const u64 *__restrict__ gate_bias_ptrs, const u64 *__restrict__ up_bias_ptrs,                           \
        const int *__restrict__ inter, int shared_slot, bf16 *__restrict__ act, int H, int I_max, int act_code, \
        float alpha, float limit
#define DECODE_DOWN_ARGS                                                                                         \
    const bf16 *__restrict__ act, const int *__restrict__ num_active, const int *__restrict__ active_slot,        \
        const int *__restrict__ active_start, const int *__restrict__ active_len,                                \
        const int *__restrict__ sorted_pair, const u64 *__restrict__ down_ptrs,                                  \
        const u64 *__restrict__ down_scale_ptrs, const float *__restrict__ down_gscale,                          \
        const int *__restrict__ slot_fmt, const u64 *__restrict__ down_bias_ptrs, const int *__restrict__ inter, \
        const float *__restrict__ topk_w, float *__restrict__ y, float *__restrict__ acc, int H, int I_max, int k, \
        int P, int atomic

// The table slot of active expert j (a decode block's blockIdx.y), or -1 when the block has
// nothing to do: past the active experts, or an expert of another weight format than FMT
// (the launch for that format serves it).
template <int FMT>
__device__ __forceinline__ int decode_block_slot(int j, const int* __restrict__ num_active,
                                                 const int* __restrict__ active_slot, const int* __restrict__ slot_fmt) {
    if (j >= *num_active) return -1;
    const int slot = active_slot[j];
    return slot_fmt[slot] == FMT ? slot : -1;
}

// A down kernel's output: position pos's value v at hidden column h, stored as y[pos, h],
// or (atomic) a routed pair's w * v added into acc[row, h] (the shared expert's positions,
// pair >= P, still store y).
__device__ __forceinline__ void store_down_value(float v, int pos, int h, const int* __restrict__ sorted_pair,
                                                 const float* __restrict__ topk_w, float* __restrict__ y,
                                                 float* __restrict__ acc, int H, int k, int P, int atomic) {
    const int pair = sorted_pair[pos];
    if (atomic && pair < P)
        atomicAdd(acc + (size_t)(pair / k) * H + h, topk_w[pair] * v);
    else
        y[(size_t)pos * H + h] = v;
}

#define LISTS_THREADS 1024

// One block of LISTS_THREADS threads, `sm` 2 n_local + 33 ints of its shared memory. slot_of[e] is expert e's table slot on this rank (0 .. n_local-1), or -1 for
// another rank's expert and for zero experts; ids outside 0..R-1 (-1 from a bad hash
// token) are nobody's. Unowned pairs get pair_pos = -1.
// Stable: positions within an expert follow pair order, so the layout is deterministic.
// slot_active[slot] (n_local + 1 of them): the slot's active index, -1 where nobody chose
// it (the wgmma gate/up's blocks by slot look theirs up: decode_wgmma_a8.cu).
// `ids` is not __restrict__: decode_route_lists wrote it in the same launch, so its loads
// must not take the read-only (non-coherent) path.
__device__ __forceinline__ void build_expert_lists(int* sm, const int* ids, int N, int k,
                                                   const int* __restrict__ slot_of, int R, int n_local, int has_shared,
                                                   int* __restrict__ num_active, int* __restrict__ active_slot,
                                                   int* __restrict__ active_start, int* __restrict__ active_len,
                                                   int* __restrict__ sorted_row, int* __restrict__ sorted_pair,
                                                   int* __restrict__ pair_pos, int* __restrict__ slot_active) {
    int* cnt = sm;                      // [n_local]
    int* start = cnt + n_local;         // [n_local]
    int* warp_totals = start + n_local;  // [LISTS_THREADS / 32 + 1]
    const int P = N * k;
    for (int i = threadIdx.x; i < n_local; i += LISTS_THREADS) cnt[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += LISTS_THREADS) {
        const int e = ids[p];
        const int sl = e >= 0 && e < R ? slot_of[e] : -1;
        if (sl >= 0) atomicAdd(&cnt[sl], 1);
    }
    __syncthreads();
    // exclusive scans over experts, LISTS_THREADS experts per round
    int pos_base = 0, act_base = 0;
    for (int e0 = 0; e0 < n_local; e0 += LISTS_THREADS) {
        const int e = e0 + threadIdx.x;
        const int c = e < n_local ? cnt[e] : 0;
        int tot_c, tot_a;
        const int off = block_exclusive_scan_1024(c, warp_totals, tot_c);
        const int aidx = block_exclusive_scan_1024(c > 0 ? 1 : 0, warp_totals, tot_a);
        if (e < n_local) slot_active[e] = c > 0 ? act_base + aidx : -1;
        if (c > 0) {
            start[e] = pos_base + off;
            active_slot[act_base + aidx] = e;
            active_start[act_base + aidx] = pos_base + off;
            active_len[act_base + aidx] = c;
        }
        pos_base += tot_c;
        act_base += tot_a;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += LISTS_THREADS) {
        const int e = ids[p];
        const int sl = e >= 0 && e < R ? slot_of[e] : -1;
        int pos = -1;
        if (sl >= 0) {
            int rank = 0;
            for (int q = 0; q < p; ++q) rank += ids[q] == e;
            pos = start[sl] + rank;
            sorted_row[pos] = p / k;
            sorted_pair[pos] = p;
        }
        pair_pos[p] = pos;
    }
    if (has_shared) {
        for (int r = threadIdx.x; r < N; r += LISTS_THREADS) {
            sorted_row[pos_base + r] = r;
            sorted_pair[pos_base + r] = P + r;
            pair_pos[P + r] = pos_base + r;
        }
        if (threadIdx.x == 0) {
            active_slot[act_base] = n_local;
            active_start[act_base] = pos_base;
            active_len[act_base] = N;
            slot_active[n_local] = act_base;
        }
    }
    if (threadIdx.x == 0) *num_active = act_base + (has_shared ? 1 : 0);
}
