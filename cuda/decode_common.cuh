// What the decode kernels share (decode.cu: CUDA-core streams of every format;
// decode_mma.cu: fp4 and fp8 weights on tensor cores): the block size, the kernels' argument
// lists, the active-expert lookup, and the expert lists' construction.
#pragma once
#include "common.cuh"

#define DECODE_WARPS 8
#define LISTS_THREADS 1024

// Where a decode block's ring is in its run through `tiles` weight tiles of KS stages each (the
// wgmma downs, whose K is a few stages): the tile and its stage of the run stage being multiplied
// (tile, ts) and of the one copied `ahead` stages on (at, ats), counted on (no division a stage).
struct TileRun {
    int KS, tiles, tile = 0, ts = 0, at = 0, ats = 0;
    __device__ __forceinline__ TileRun(int ks, int n) : KS(ks), tiles(n) {}
    __device__ __forceinline__ void start(int ahead) {
        ats = ahead;
        while (ats >= KS) ats -= KS, ++at;
    }
    // After run stage (tile, ts) is multiplied: a tile's sums, whole but for the last tile's, go
    // to done(tile, acc) and are zeroed for the next; then both positions step on.
    template <int N, class Done>
    __device__ __forceinline__ void step(float (&acc)[2][N], Done& done) {
        if (ts == KS - 1 && tile + 1 < tiles) {
            done(tile, acc);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int i = 0; i < N; ++i) acc[m][i] = 0.0f;
        }
        if (++ts == KS) ts = 0, ++tile;
        if (++ats == KS) ats = 0, ++at;
    }
};

// The decode expert kernels' argument lists: the layer launches the CUDA-core and the
// tensor-core kernels of a stage with one argument tuple, so they share one list.
// gate/up: x (the shared expert's input) and xe (the routed experts'), the active lists,
// per-slot weight / scale / global-scale / bias tables, each slot's format and width, and
// act [positions, I_max] out ([positions, 2 I_max]: g and u, with act_code ACT_PAIR). down: act in, the same tables, the routing weights, and y
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

// A decode gate/up block's table slot, or -1 where it leaves: by table slot where `slot_active` is
// set (the grid's y is the slot; another format's slot leaves before any wait, its launch serves
// it), else by active expert y, once the lists have landed (the PDL wait first).
template <int FMT>
__device__ __forceinline__ int gate_up_block_slot(const int* __restrict__ slot_active,
                                                  const int* __restrict__ num_active,
                                                  const int* __restrict__ active_slot,
                                                  const int* __restrict__ slot_fmt) {
    if (slot_active) {
        if (slot_fmt[blockIdx.y] == FMT) return blockIdx.y;
        pdl_leave_early();
        return -1;
    }
    pdl_wait_then_release_next();
    return decode_block_slot<FMT>(blockIdx.y, num_active, active_slot, slot_fmt);
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

#define LISTS_MAX_ROUNDS 4  // build_expert_lists: pairs a thread at most (catalog.LISTS_MAX_ROUNDS)

// One block of LISTS_THREADS threads, P = N k <= ROUNDS LISTS_THREADS pairs (pair p on thread
// p % LISTS_THREADS, in round p / LISTS_THREADS: 32 consecutive pairs are one warp's chunk),
// `sm` n_local ints and ceil(P / 32) n_local 16-bit counts of its shared memory
// (kernels.expert_lists_smem_bytes). id_of(p) is pair p's expert id; slot_of[e] (the
// callers' copy in shared memory) is expert e's table slot on this rank (0 .. n_local-1),
// or -1 for another rank's expert and for zero experts; ids outside 0..R-1 (-1 from a bad
// hash token) are nobody's. Unowned pairs get pair_pos = -1.
// Stable: positions within an expert follow pair order, so the layout is deterministic.
// slot_active[slot] (n_local + 1 of them): the slot's active index, -1 where nobody chose
// it (a decode gate/up's blocks by slot look theirs up: gate_up_block_slot's callers,
// decode_wgmma_a8.cu and decode_swapab_sm90.cu).
// A pair's rank among its expert's pairs is sort_place's (common.cuh warp_slot_rank: a
// match in its warp and the warps' counts before it), which also gives each expert's count;
// one warp then places the experts: each lane a run of ceil(n_local / 32) of them, one warp
// scan of (count, active) packed in an int. Why: no pair walks the pairs before it by global
// loads and no 1024-thread block scan sits in the chain. The one warp's loops are rolled, as
// is the walk of each expert's column: this code runs once a launch, so its length costs
// more than its latency (cold instruction fetch, likely).
template <int ROUNDS, class IdOf>
__device__ __forceinline__ void build_expert_lists(int* sm, IdOf id_of, int N, int k,
                                                   const int* slot_of, int R, int n_local, int has_shared,
                                                   int* __restrict__ num_active, int* __restrict__ active_slot,
                                                   int* __restrict__ active_start, int* __restrict__ active_len,
                                                   int* __restrict__ sorted_row, int* __restrict__ sorted_pair,
                                                   int* __restrict__ pair_pos, int* __restrict__ slot_active) {
    static_assert(ROUNDS >= 1 && ROUNDS <= LISTS_MAX_ROUNDS, "pairs a thread");
    const int P = N * k, warps = (P + 31) >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* start = sm;                                                             // [n_local]
    unsigned short* before = reinterpret_cast<unsigned short*>(start + n_local);  // [warps][n_local]
    for (int i = threadIdx.x; i < warps * n_local; i += LISTS_THREADS) before[i] = 0;
    __syncthreads();
    int sl[ROUNDS], rank[ROUNDS];  // the thread's pair of each round: its slot, its rank
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {  // every round's id loads before the first match
        const int p = r * LISTS_THREADS + threadIdx.x;
        const int e = p < P ? id_of(p) : -1;
        sl[r] = e >= 0 && e < R ? slot_of[e] : -1;
    }
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int chunk = r * (LISTS_THREADS / 32) + warp;  // warp-uniform
        rank[r] = chunk < warps ? warp_slot_rank(before, n_local, sl[r], chunk, lane) : 0;
    }
    __syncthreads();
#pragma unroll 1
    for (int x = threadIdx.x; x < n_local; x += LISTS_THREADS)  // each expert's count
        start[x] = warps_exclusive_prefix(before, n_local, warps, x);
    __syncthreads();
    // warp 0 places the experts, lane L those from L * per: its run's count and active
    // experts (high 16 bits: positions, at most P; low: active ones, under 2^16 since 6
    // bytes of shared memory an expert fit no more), one scan;
    // then the shared expert's run after the routed ones
    if (warp == 0) {
        const int per = (n_local + 31) >> 5, x0 = lane * per, x1 = min(x0 + per, n_local);
        int run = 0;
#pragma unroll 1
        for (int x = x0; x < x1; ++x) run += (start[x] << 16) | (start[x] > 0 ? 1 : 0);
        int total;
        const int excl = warp_inclusive_scan(run, lane, total) - run;
        int pos = excl >> 16, a = excl & 0xffff;
#pragma unroll 1
        for (int x = x0; x < x1; ++x) {
            const int c = start[x];
            slot_active[x] = c > 0 ? a : -1;
            start[x] = pos;
            if (c > 0) {
                active_slot[a] = x;
                active_start[a] = pos;
                active_len[a] = c;
                ++a;
            }
            pos += c;
        }
        const int pos_base = total >> 16, act_base = total & 0xffff;
        if (has_shared) {
#pragma unroll 1
            for (int r = lane; r < N; r += 32) {
                sorted_row[pos_base + r] = r;
                sorted_pair[pos_base + r] = P + r;
                pair_pos[P + r] = pos_base + r;
            }
            if (lane == 0) {
                active_slot[act_base] = n_local;
                active_start[act_base] = pos_base;
                active_len[act_base] = N;
                slot_active[n_local] = act_base;
            }
        }
        if (lane == 0) *num_active = act_base + (has_shared ? 1 : 0);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const int p = r * LISTS_THREADS + threadIdx.x;
        if (p < P) {
            int pos = -1;
            if (sl[r] >= 0) {
                pos = start[sl[r]] + before[(r * (LISTS_THREADS / 32) + warp) * n_local + sl[r]] + rank[r];
                sorted_row[pos] = p / k;
                sorted_pair[pos] = p;
            }
            pair_pos[p] = pos;
        }
    }
}
