// Decode path (small N): every stage is ONE launch for all N rows, and every selected
// expert's weights stream from HBM once per step however many rows chose it.
//
//   decode_build_lists  (row, slot) pairs grouped by expert: the active experts, each one's
//                       run of positions, the row of each position, and pair -> position.
//                       The shared expert is one more "expert" (table slot `n_local`)
//                       that every row chose, so it rides through the same two kernels.
//   decode_route_lists  the routing stage (topk.cu's) and the lists in one launch, for
//                       a few rows.
//   decode_gate_up<RT, CW, FMT>  one warp per CW intermediate columns of one active expert:
//                       streams the gate and up rows once per RT-row tile, act(g, u) fused,
//                       bf16 out.
//   decode_down<RT, CW, FMT>     one warp per CW hidden columns of one active expert:
//                       y = act . W_down, fp32 out per position, or (atomic path) w * y
//                       added into acc[row].
//                       FMT is the weights' format (quant.cuh); a launch serves the active
//                       experts of its format and skips the others, so a layer whose
//                       shared expert is bf16 next to quantized routed experts launches
//                       each kernel once per format.
//   decode_reduce       out[row] = sum_slots w * y (+ zero-expert w * x) + scale * shared,
//                       the sum in slot order, so the result is reproducible bit for bit.
#include "common.cuh"
#include "decode_common.cuh"
#include "quant.cuh"
#include "routing.cuh"
#include "lora_common.cuh"  // the folded LoRA router delta (decode_route_lists_lora)

// One block per SM at minimum: ptxas may then give each variant the registers it needs
// (with no minimum it capped some variants at 64 and spilled; with 2, gate_up<1, 4> spilled
// on sm_80). kernels --arch checks every variant for spills.
#define DECODE_MIN_BLOCKS 1

// Steps of the K loop unrolled: enough that a lane keeps ~8 bf16 weight loads in flight
// (16 of the 4-byte fp4 loads), since at few rows the kernels are bound by the latency of too
// few bytes in flight (Nsight Compute: 46-56 % of DRAM bandwidth at N = 1 with 2 steps).
// `loads` = weight loads per step, times the rows each is used for (more rows per tile
// already give each load more work and take registers). fp8 keeps 2: more steps cost its
// readers registers and occupancy for no more bandwidth.
__host__ __device__ constexpr int decode_unroll(int fmt, int loads) {
    return fmt == FMT_FP8 ? 2 : ((fmt == FMT_BF16 ? 8 : 16) / loads > 2 ? (fmt == FMT_BF16 ? 8 : 16) / loads : 2);
}
// grid 1, block LISTS_THREADS, dynamic smem R ints (the slot table, copied before the wait
// for top-k: its lookups would be global round trips after it) + build_expert_lists'. ROUNDS:
// pairs a thread, N k <= ROUNDS LISTS_THREADS.
template <int ROUNDS>
__global__ void __launch_bounds__(LISTS_THREADS)
decode_build_lists(const int* __restrict__ ids, int N, int k, const int* __restrict__ slot_of, int R,
                   int n_local, int has_shared,
                   int* __restrict__ num_active, int* __restrict__ active_slot, int* __restrict__ active_start,
                   int* __restrict__ active_len, int* __restrict__ sorted_row, int* __restrict__ sorted_pair,
                   int* __restrict__ pair_pos, int* __restrict__ slot_active) {
    extern __shared__ int sm[];
    for (int e = threadIdx.x; e < R; e += LISTS_THREADS) sm[e] = slot_of[e];  // the layer's, constant
    pdl_wait_then_release_next();  // (build_expert_lists' first barrier orders the copies)
    build_expert_lists<ROUNDS>(sm + R, [&](int p) { return ids[p]; }, N, k, sm, R, n_local, has_shared, num_active,
                       active_slot, active_start, active_len, sorted_row, sorted_pair, pair_pos, slot_active);
}

// The expert lists of a few pairs (decode_route_lists), the same lists as
// build_expert_lists but without its scans over every expert: each thread takes pairs and
// counts, over all P pairs, those sorting before its own (by slot, then pair order),
// those of its slot, and (second pass) the distinct slots before its own. O(P^2 / threads)
// shared-memory reads, fewer than the scans' barriers and the ids' round trips for the
// P <= 8 k of the fused routing launch. `ids` (shared memory): pair p's expert id at
// ids[(p / k) * ids_stride + p % k]; `sm` 2 P ints of shared scratch; `slot_of` the layer's
// slot table (decode_route_lists' copy in shared memory).
__device__ __forceinline__ void build_few_expert_lists(int* sm, const int* ids, int ids_stride, int N, int k,
                                                       const int* slot_of, int R, int n_local,
                                                       int has_shared, int* __restrict__ num_active,
                                                       int* __restrict__ active_slot, int* __restrict__ active_start,
                                                       int* __restrict__ active_len, int* __restrict__ sorted_row,
                                                       int* __restrict__ sorted_pair, int* __restrict__ pair_pos,
                                                       int* __restrict__ slot_active) {
    const int P = N * k;
    int* slot = sm;       // [P]: pair p's table slot, -1 when nobody's here
    int* first = sm + P;  // [P]: 1 where p is its slot's first pair
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int e = ids[(p / k) * ids_stride + p % k];
        slot[p] = e >= 0 && e < R ? slot_of[e] : -1;
    }
    for (int e = threadIdx.x; e <= n_local; e += blockDim.x) slot_active[e] = -1;  // the active ones below
    __syncthreads();
    int owned = 0;  // pairs on this rank: the shared expert's rows follow them
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int sl = slot[p];
        int before = 0, same_before = 0;
        owned = 0;
        for (int q = 0; q < P; ++q) {
            const int sq = slot[q];
            owned += sq >= 0;
            before += sq >= 0 && sq < sl;
            same_before += q < p && sq == sl;
        }
        const int pos = sl >= 0 ? before + same_before : -1;
        first[p] = sl >= 0 && same_before == 0;
        if (pos >= 0) {
            sorted_row[pos] = p / k;
            sorted_pair[pos] = p;
        }
        pair_pos[p] = pos;
    }
    __syncthreads();
    int active = 0;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int sl = slot[p];
        int a = 0, start = 0, len = 0;
        active = 0;
        for (int q = 0; q < P; ++q) {
            const int sq = slot[q];
            active += first[q];
            a += first[q] && sq < sl;
            start += sq >= 0 && sq < sl;
            len += sq == sl;
        }
        if (first[p]) {
            active_slot[a] = sl;
            active_start[a] = start;
            active_len[a] = len;
            slot_active[sl] = a;
        }
    }
    if (threadIdx.x == 0 && P > 0) {  // thread 0 took pair 0, so its counts cover every pair
        if (has_shared) {
            active_slot[active] = n_local;
            active_start[active] = owned;
            active_len[active] = N;
            slot_active[n_local] = active;
        }
        *num_active = active + (has_shared ? 1 : 0);
    }
    if (has_shared)  // thread r < N took pair r (P = N k >= N), so its `owned` is counted
        for (int r = threadIdx.x; r < N; r += blockDim.x) {
            sorted_row[owned + r] = r;
            sorted_pair[owned + r] = P + r;
            pair_pos[P + r] = owned + r;
        }
}

// The expert lists of one row's k <= 32 pairs by its routing warp alone (decode_route_lists
// at N = 1): pair t on lane t, and each count build_few_expert_lists makes over shared
// memory between two block barriers made over the warp's registers instead (k shuffles a
// count). The same lists: a row's ids are distinct experts unless a hash table repeats one,
// and the counts give repeats their places as build_few_expert_lists does. Why: route_lists
// is a link of the chain (router -> route_lists -> gate/up, each waiting for the one before),
// and a warp's shuffles are shorter than the block's barriers. `ids` the row's k ids (shared
// memory, written by this warp before a __syncwarp), `slot_of` the slot table.
__device__ __forceinline__ void warp_expert_lists(const int* ids, int k, const int* slot_of, int R, int n_local,
                                                  int has_shared, int* __restrict__ num_active,
                                                  int* __restrict__ active_slot, int* __restrict__ active_start,
                                                  int* __restrict__ active_len, int* __restrict__ sorted_row,
                                                  int* __restrict__ sorted_pair, int* __restrict__ pair_pos,
                                                  int* __restrict__ slot_active, int lane) {
    const int e = lane < k ? ids[lane] : -1;
    const int sl = e >= 0 && e < R ? slot_of[e] : -1;
    for (int i = lane; i <= n_local; i += 32) slot_active[i] = -1;  // the active ones below
    int before = 0, same_before = 0, len = 0, owned = 0;
    for (int q = 0; q < k; ++q) {
        const int sq = __shfl_sync(CUPYMOE_FULL_MASK, sl, q);
        owned += sq >= 0;
        before += sq >= 0 && sq < sl;
        same_before += q < lane && sq == sl;
        len += sq == sl;
    }
    const bool first = sl >= 0 && same_before == 0;
    const unsigned firsts = __ballot_sync(CUPYMOE_FULL_MASK, first);
    int a = 0;  // distinct slots before this one: its active index
    for (int q = 0; q < k; ++q)
        a += ((firsts >> q) & 1u) && __shfl_sync(CUPYMOE_FULL_MASK, sl, q) < sl;
    const int active = __popc(firsts);
    __syncwarp();  // the -1s above land before the active indices below (same addresses, other lanes)
    if (lane < k) {
        const int pos = sl >= 0 ? before + same_before : -1;
        if (pos >= 0) {
            sorted_row[pos] = 0;
            sorted_pair[pos] = lane;
        }
        pair_pos[lane] = pos;
        if (first) {
            active_slot[a] = sl;
            active_start[a] = before;
            active_len[a] = len;
            slot_active[sl] = a;
        }
    }
    if (lane == 0) {
        if (has_shared) {
            active_slot[active] = n_local;
            active_start[active] = owned;
            active_len[active] = 1;
            slot_active[n_local] = active;
            sorted_row[owned] = 0;
            sorted_pair[owned] = k;
            pair_pos[k] = owned;
        }
        *num_active = active + (has_shared ? 1 : 0);
    }
}

// The routing stage and the expert lists in one launch, for a few rows (the decode path's
// N = 1 .. ROUTE_LISTS_MAX_ROWS: one launch fewer in its chain): warp w routes row w as
// topk_route does (routing.cuh), then the block builds the lists from the ids the warps
// left in shared memory (build_few_expert_lists); one row's warp builds them alone
// (warp_expert_lists). With `qx` (w8a8, few rows), the warps that route no row quantize x
// meanwhile (else the router does: router.cu). The slot table is copied into shared memory
// before the wait for the router: its lookups were global round trips after the routing.
// grid 1, block ROUTE_LISTS_THREADS (>= 32 N), dynamic smem N (2 R + TOPK_MAX_K) floats +
// 2 N k + R ints.
#define ROUTE_LISTS_THREADS 256
// decode_route_lists after its wait: the rows' routing from `logits` (the router's, or
// decode_route_lists_lora's rows with the LoRA delta added), the w8a8 quantization and the lists.
__device__ __forceinline__ void route_lists_body(
    float* route_smem, const int* slot_tab, const float* logits, const float* __restrict__ corr_bias,
    const int* __restrict__ tid2eid, const int* __restrict__ token_ids, int* __restrict__ ids_out,
    float* __restrict__ w_out, int* __restrict__ err, int N, int R, int E, int k, int scoring, int n_group,
    int topk_group, int topk_then_softmax, int renorm, float scale, int vocab, int n_local, int has_shared,
    int* __restrict__ num_active, int* __restrict__ active_slot, int* __restrict__ active_start,
    int* __restrict__ active_len, int* __restrict__ sorted_row, int* __restrict__ sorted_pair,
    int* __restrict__ pair_pos, int* __restrict__ slot_active, const bf16* __restrict__ x, int H,
    u8* __restrict__ qx, float* __restrict__ sx, int warp, int lane) {
    const int stride = 2 * R + TOPK_MAX_K;  // a row's scratch; its ids at 2 R (route_row)
    if (warp < N)
        route_row(warp, route_smem + (size_t)warp * stride, logits, corr_bias, tid2eid, token_ids, ids_out, w_out,
                  err, R, E, k, scoring, n_group, topk_group, topk_then_softmax, renorm, scale, vocab, lane, true);
#if CUPYMOE_SM >= 89
    // w8a8 at very few rows (qx set: layer.route_lists_quantizes): the warps
    // that route no row quantize x beside the routing, 256 columns of a row a unit
    else if (qx) {
        e4m3_quantize_units(x, N, H, qx, sx, warp - N, ROUTE_LISTS_THREADS / 32 - N, lane);
    }
#endif
    if (N == 1 && k <= 32) {  // the routing warp's lists: no block barrier
        if (warp == 0) {
            __syncwarp();  // route_row's ids in shared memory
            warp_expert_lists(reinterpret_cast<const int*>(route_smem) + 2 * R, k, slot_tab, R, n_local, has_shared,
                              num_active, active_slot, active_start, active_len, sorted_row, sorted_pair, pair_pos,
                              slot_active, lane);
        }
        return;
    }
    __syncthreads();
    build_few_expert_lists(reinterpret_cast<int*>(route_smem + (size_t)N * stride),
                           reinterpret_cast<const int*>(route_smem) + 2 * R, stride, N, k, slot_tab, R, n_local,
                           has_shared, num_active, active_slot, active_start, active_len, sorted_row, sorted_pair,
                           pair_pos, slot_active);
}

#define ROUTE_LISTS_ARGS                                                                                             \
    const float *__restrict__ logits, const float *__restrict__ corr_bias, const int *__restrict__ tid2eid,          \
        const int *__restrict__ token_ids, int *__restrict__ ids_out, float *__restrict__ w_out,                     \
        int *__restrict__ err, int N, int R, int E, int k, int scoring, int n_group, int topk_group,                 \
        int topk_then_softmax, int renorm, float scale, int vocab, const int *__restrict__ slot_of, int n_local,     \
        int has_shared, int *__restrict__ num_active, int *__restrict__ active_slot,                                 \
        int *__restrict__ active_start, int *__restrict__ active_len, int *__restrict__ sorted_row,                  \
        int *__restrict__ sorted_pair, int *__restrict__ pair_pos, int *__restrict__ slot_active,                    \
        const bf16 *__restrict__ x, int H, u8 *__restrict__ qx, float *__restrict__ sx
#define ROUTE_LISTS_BODY_ARGS(LOGITS)                                                                                \
    LOGITS, corr_bias, tid2eid, token_ids, ids_out, w_out, err, N, R, E, k, scoring, n_group, topk_group,            \
        topk_then_softmax, renorm, scale, vocab, n_local, has_shared, num_active, active_slot, active_start,         \
        active_len, sorted_row, sorted_pair, pair_pos, slot_active, x, H, qx, sx, warp, lane

__global__ void __launch_bounds__(ROUTE_LISTS_THREADS) decode_route_lists(ROUTE_LISTS_ARGS) {
    extern __shared__ float route_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = 2 * R + TOPK_MAX_K;
    int* slot_tab = reinterpret_cast<int*>(route_smem + (size_t)N * stride) + 2 * N * k;  // [R]
    for (int e = threadIdx.x; e < R; e += ROUTE_LISTS_THREADS) slot_tab[e] = slot_of[e];  // the layer's, constant
    __syncthreads();
    pdl_wait_then_release_next();
    route_lists_body(route_smem, slot_tab, ROUTE_LISTS_BODY_ARGS(logits));
}

// decode_route_lists with the router's LoRA delta folded in (forward_plan.lora_fold: the decode
// chain's fewest rows), one launch fewer than lora_router_delta + decode_route_lists: its router,
// router_logits_bf16_lora, left S <= LORA_FOLD_SLICES shares of each delta in part [row][s][R]
// (rows with an adapter). After the wait a row's logit plus its shares summed in slice order (all
// S loads in flight together) goes to shared memory, which the warps route. Rows with id -1 (or
// >= K, flagged by the router) add nothing; the ids go to shared memory before the wait (the
// call's input: their load is off the chain). Dynamic smem: decode_route_lists', then (16-byte
// aligned) N R floats and N ints (catalog.route_lists_lora_smem_bytes).
__global__ void __launch_bounds__(ROUTE_LISTS_THREADS)
decode_route_lists_lora(ROUTE_LISTS_ARGS, const int* __restrict__ lora_ids, const float* __restrict__ part, int S,
                        int max_loras) {
    extern __shared__ float route_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = 2 * R + TOPK_MAX_K;
    int* slot_tab = reinterpret_cast<int*>(route_smem + (size_t)N * stride) + 2 * N * k;  // [R]
    float* rows = route_smem + (((size_t)N * stride + 2 * N * k + R + 3) & ~(size_t)3);  // [N][R]: what the warps route
    int* ids = reinterpret_cast<int*>(rows + (size_t)N * R);                             // [N]: the rows' adapters
    for (int e = threadIdx.x; e < R; e += ROUTE_LISTS_THREADS) slot_tab[e] = slot_of[e];  // the layer's, constant
    for (int r = threadIdx.x; r < N; r += ROUTE_LISTS_THREADS) ids[r] = lora_ids[r];   // the call's, before the chain
    __syncthreads();
    pdl_wait_then_release_next();  // the router's logits and delta shares from here on
    for (int e = threadIdx.x; e < N * R; e += ROUTE_LISTS_THREADS) {
        const int r = e / R, id = ids[r];
        float v = logits[e];
        if (id >= 0 && id < max_loras) {
            const float* share = part + (size_t)r * S * R + (e - r * R);
            float d[LORA_FOLD_SLICES];
#pragma unroll
            for (int i = 0; i < LORA_FOLD_SLICES; ++i) d[i] = i < S ? __ldcg(share + (size_t)i * R) : 0.f;
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < LORA_FOLD_SLICES; ++i)
                if (i < S) sum += d[i];
            v += sum;
        }
        rows[e] = v;
    }
    __syncthreads();
    route_lists_body(route_smem, slot_tab, ROUTE_LISTS_BODY_ARGS(rows));
}

// The routing stage and the expert lists in one launch past decode_route_lists' rows (up to
// TOPK_LISTS_WARPS rows, one a warp: two a warp past that measured slower than the two
// launches): its warps route the rows as topk_route does
// (the register path where it serves, routing.cuh: the same choices and weights), then the
// block builds the lists from the ids they left in shared memory (build_expert_lists; read
// back from ids_out they were a global round trip after the barrier). One kernel boundary
// fewer than topk_route + decode_build_lists. Not for a split router (its copies' sum is topk_route's),
// nor past R = 256: topk_route's register path for wider routers (route_row_vec<4>) does
// not fit 64 registers beside the lists, and the shared-memory path's weights may differ
// from it in their last bits.
// The slot table is copied into shared memory before the wait for the router, as
// decode_route_lists does.
// grid 1, block LISTS_THREADS, dynamic smem N (2 R + TOPK_MAX_K) floats (a row's scratch) + R
// ints + build_expert_lists' (opted in past 48 KB); N <= TOPK_LISTS_WARPS, R <= TOPK_LISTS_MAX_R.
#define TOPK_LISTS_MAX_R 256
#define TOPK_LISTS_WARPS 32  // every warp of the block
// Its one block an SM: without it ptxas may hold the kernel at 32 registers (two blocks an SM)
// and spill.
#define TOPK_LISTS_BOUNDS __launch_bounds__(LISTS_THREADS, 1)
template <int GROUP_REGS>  // as topk_route's
__global__ void TOPK_LISTS_BOUNDS
decode_topk_lists(const float* __restrict__ logits, const float* __restrict__ corr_bias,
                  const int* __restrict__ tid2eid, const int* __restrict__ token_ids, int* __restrict__ ids_out,
                  float* __restrict__ w_out, int* __restrict__ err, int N, int R, int E, int k, int scoring,
                  int n_group, int topk_group, int topk_then_softmax, int renorm, float scale, int vocab,
                  const int* __restrict__ slot_of, int n_local, int has_shared, int* __restrict__ num_active,
                  int* __restrict__ active_slot, int* __restrict__ active_start, int* __restrict__ active_len,
                  int* __restrict__ sorted_row, int* __restrict__ sorted_pair, int* __restrict__ pair_pos,
                  int* __restrict__ slot_active) {
    extern __shared__ float topk_lists_smem[];
    // [R] past the routing scratch (its address made again after the routing: kept live
    // across it, it made decode_topk_lists<1> spill at its 64 registers)
    const auto slot_table = [&] {
        return reinterpret_cast<int*>(topk_lists_smem + (size_t)N * (2 * R + TOPK_MAX_K));
    };
    for (int e = threadIdx.x; e < R; e += LISTS_THREADS) slot_table()[e] = slot_of[e];  // the layer's, constant
    pdl_wait_then_release_next();  // (the barrier below orders the copies)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = 2 * R + TOPK_MAX_K;  // a warp's routing scratch; its row's ids at 2 R
    if (warp < N) {
        // R <= TOPK_LISTS_MAX_R: topk_route's register path for wider routers (4 registers a
        // lane) does not fit beside the lists
        route_row_topk<2, GROUP_REGS != 0, true>(warp, topk_lists_smem + (size_t)warp * stride, logits, corr_bias,
                                                 tid2eid, token_ids, ids_out, w_out, err, R, E, k, scoring, n_group,
                                                 topk_group, topk_then_softmax, renorm, scale, vocab, lane);
    }
    __syncthreads();  // every row's ids, left in its warp's scratch, are visible to the whole block
    int* slot_tab = slot_table();
    const int* row_ids = reinterpret_cast<const int*>(topk_lists_smem) + 2 * R;
    build_expert_lists<1>(  // N k <= LISTS_THREADS (TOPK_LISTS_WARPS rows)
        slot_tab + R, [&](int p) { return row_ids[(p / k) * stride + p % k]; }, N, k, slot_tab, R, n_local,
        has_shared, num_active, active_slot, active_start, active_len, sorted_row, sorted_pair, pair_pos,
        slot_active);
}

// grid (ceil(I_max / (DECODE_WARPS * CW)), max_active), block DECODE_WARPS * 32.
// Each warp owns CW intermediate columns: CW gate rows and CW up rows stream together, so a
// warp keeps 4 * CW 16-byte loads in flight and few warps cover a small step in one wave.
template <int RT, int CW, int FMT>
__global__ void __launch_bounds__(DECODE_WARPS * 32, DECODE_MIN_BLOCKS)
decode_gate_up(DECODE_GATE_UP_ARGS) {
    pdl_wait_then_release_next();
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int I = inter[slot];
    const int col0 = (blockIdx.x * DECODE_WARPS + warp) * CW;
    if (col0 >= I) return;
    // The shared expert reads x; routed experts read the (optionally pre-normed) xe.
    const bf16* in = slot == shared_slot ? x : xe;
    QRow wg[CW], wu[CW];
#pragma unroll
    for (int c = 0; c < CW; ++c) {  // a column past I recomputes column I - 1 and writes nothing
        const int col = min(col0 + c, I - 1);
        wg[c] = q_row<FMT>(reinterpret_cast<const void*>(gate_ptrs[slot]),
                           reinterpret_cast<const void*>(gate_scale_ptrs[slot]), col, H);
        wu[c] = q_row<FMT>(reinterpret_cast<const void*>(up_ptrs[slot]),
                           reinterpret_cast<const void*>(up_scale_ptrs[slot]), col, H);
    }
    const float gsg = gate_gscale[slot], gsu = up_gscale[slot];  // nvfp4's scale_2, else 1
    const float* bg = reinterpret_cast<const float*>(gate_bias_ptrs[slot]);
    const float* bu = reinterpret_cast<const float*>(up_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];

    for (int r0 = 0; r0 < len; r0 += RT) {
        // A tile past the run's end recomputes its last row (cached) and writes nothing:
        // no divergence and no run-time-indexed arrays in the hot loop.
        const bf16* xr[RT];
        float ag[RT][CW], au[RT][CW];
#pragma unroll
        for (int i = 0; i < RT; ++i) {
            xr[i] = in + (size_t)sorted_row[start + min(r0 + i, len - 1)] * H;
#pragma unroll
            for (int c = 0; c < CW; ++c) ag[i][c] = au[i][c] = 0.0f;
        }
#pragma unroll(decode_unroll(FMT, 2 * CW * RT))
        for (int kk = lane * 8; kk < H; kk += 256) {
            WChunk<FMT> vg[CW], vu[CW];
#pragma unroll
            for (int c = 0; c < CW; ++c) {
                vg[c].load(wg[c], kk);
                vu[c].load(wu[c], kk);
            }
#pragma unroll
            for (int i = 0; i < RT; ++i) {
                float fx[8];
                unpack_bf16x8(load_bf16x8(xr[i] + kk), fx);
#pragma unroll
                for (int c = 0; c < CW; ++c) {
                    ag[i][c] = vg[c].dot(fx, ag[i][c]);
                    au[i][c] = vu[c].dot(fx, au[i][c]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int c = 0; c < CW; ++c) {
                const float g = warp_sum(ag[i][c]) * gsg;
                const float u = warp_sum(au[i][c]) * gsu;
                const int col = col0 + c;
                if (lane == 0 && r0 + i < len && col < I) {
                    const float gb = g + (bg ? bg[col] : 0.0f);
                    const float ub = u + (bu ? bu[col] : 0.0f);
                    store_gate_up(act, (size_t)(start + r0 + i), col, I_max, act_code, gb, ub, alpha, limit);
                }
            }
    }
}

// grid (ceil(H / (DECODE_WARPS * CW)), max_active), block DECODE_WARPS * 32; CW hidden columns
// per warp. atomic == 0: y[pos, h] = act[pos] . W_down[h] (+ bias).
// atomic == 1: routed pairs add w * y into acc[row, h]; the shared expert still stores y.
template <int RT, int CW, int FMT>
__global__ void __launch_bounds__(DECODE_WARPS * 32, DECODE_MIN_BLOCKS)
decode_down(DECODE_DOWN_ARGS) {
    pdl_wait_then_release_next();
    const int j = blockIdx.y;
    const int slot = decode_block_slot<FMT>(j, num_active, active_slot, slot_fmt);
    if (slot < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int I = inter[slot];
    const int h0 = (blockIdx.x * DECODE_WARPS + warp) * CW;
    if (h0 >= H) return;
    QRow wd[CW];
#pragma unroll
    for (int c = 0; c < CW; ++c)
        wd[c] = q_row<FMT>(reinterpret_cast<const void*>(down_ptrs[slot]),
                           reinterpret_cast<const void*>(down_scale_ptrs[slot]), min(h0 + c, H - 1), I);
    const float gsd = down_gscale[slot];  // nvfp4's scale_2, else 1
    const float* bd = reinterpret_cast<const float*>(down_bias_ptrs[slot]);
    const int start = active_start[j], len = active_len[j];

    for (int r0 = 0; r0 < len; r0 += RT) {
        float a[RT][CW];
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int c = 0; c < CW; ++c) a[i][c] = 0.0f;
#pragma unroll(decode_unroll(FMT, CW * RT))
        for (int kk = lane * 8; kk < I; kk += 256) {
            WChunk<FMT> vw[CW];
#pragma unroll
            for (int c = 0; c < CW; ++c) vw[c].load(wd[c], kk);
#pragma unroll
            for (int i = 0; i < RT; ++i) {
                const size_t pos = start + min(r0 + i, len - 1);  // past the end: recompute, don't write
                float fa[8];
                unpack_bf16x8(load_bf16x8(act + pos * I_max + kk), fa);
#pragma unroll
                for (int c = 0; c < CW; ++c) a[i][c] = vw[c].dot(fa, a[i][c]);
            }
        }
#pragma unroll
        for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int c = 0; c < CW; ++c) {
                const int h = h0 + c;
                const float v = warp_sum(a[i][c]) * gsd + (bd ? bd[min(h, H - 1)] : 0.0f);
                if (lane == 0 && r0 + i < len && h < H)
                    store_down_value(v, start + r0 + i, h, sorted_pair, topk_w, y, acc, H, k, P, atomic);
            }
    }
}

// grid (N, column blocks), block 256. out[row] = routed terms + zero-expert terms + shared
// term, in bf16. A few rows split H over blocks (the layer's REDUCE_SPLIT_ROWS): one row's
// 4 H bytes of y per slot are then read by many SMs at once instead of one block's loop.
// `primary` (EP rank 0, or no EP) adds the zero-expert and shared terms, which belong to
// no rank's experts and must be counted once across the ranks' partial outputs.
// The row's slot table (position, weight) goes to shared memory first, so the loads of the
// k expert outputs are independent and all in flight at once. That prologue runs before the
// wait for down (PDL): it reads only the routing stage's and the lists' outputs, the input
// and the weights, which the kernels before gate/up wrote (down's blocks passed their wait
// for gate/up, whose blocks passed theirs for the lists, before this grid could launch), so
// after down only its outputs' loads are left in the chain.
#define REDUCE_THREADS 256
__global__ void __launch_bounds__(REDUCE_THREADS, 4)  // 4: up to 64 registers (ptxas chose 32 and spilled)
decode_reduce(const bf16* __restrict__ x, const bf16* __restrict__ xe, const int* __restrict__ ids,
              const float* __restrict__ topk_w, const int* __restrict__ pair_pos, const float* __restrict__ y,
              const float* __restrict__ acc, const float* __restrict__ shared_gate_w, bf16* __restrict__ out,
              int N, int H, int k, int E, int has_shared, int primary, int atomic) {
    __shared__ int s_pos[64];
    __shared__ float s_w[64];
    const int row = blockIdx.x;
    const size_t rbase = (size_t)row * H;
    const RowPrologue pro = reduce_row_prologue<REDUCE_THREADS>(row, N, k, E, H, pair_pos, ids, topk_w, x, shared_gate_w,
                                                                has_shared, primary, atomic, s_pos, s_w);
    pdl_wait_then_release_next();  // down's y (and the atomic path's acc) from here on
    const float scale = pro.shared_scale, zw = pro.zero_w;
    const int shared_pos = pro.shared_pos;
    for (int h = (blockIdx.y * REDUCE_THREADS + threadIdx.x) * 4; h < H; h += gridDim.y * REDUCE_THREADS * 4) {
        float4 o = atomic ? *reinterpret_cast<const float4*>(acc + rbase + h) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < k; ++s) {
            const int pos = s_pos[s];
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (pos >= 0) v = *reinterpret_cast<const float4*>(y + (size_t)pos * H + h);
            const float w = s_w[s];
            o.x = fmaf(w, v.x, o.x);
            o.y = fmaf(w, v.y, o.y);
            o.z = fmaf(w, v.z, o.z);
            o.w = fmaf(w, v.w, o.w);
        }
        if (zw != 0.0f) {
            const __nv_bfloat162* xv = reinterpret_cast<const __nv_bfloat162*>(xe + rbase + h);
            const float2 a = __bfloat1622float2(xv[0]), b = __bfloat1622float2(xv[1]);
            o.x = fmaf(zw, a.x, o.x);
            o.y = fmaf(zw, a.y, o.y);
            o.z = fmaf(zw, b.x, o.z);
            o.w = fmaf(zw, b.y, o.w);
        }
        if (shared_pos >= 0) {
            const float4 v = *reinterpret_cast<const float4*>(y + (size_t)shared_pos * H + h);
            o.x = fmaf(scale, v.x, o.x);
            o.y = fmaf(scale, v.y, o.y);
            o.z = fmaf(scale, v.z, o.z);
            o.w = fmaf(scale, v.w, o.w);
        }
        __nv_bfloat162 r[2] = {__floats2bfloat162_rn(o.x, o.y), __floats2bfloat162_rn(o.z, o.w)};
        *reinterpret_cast<uint2*>(out + rbase + h) = *reinterpret_cast<const uint2*>(r);
    }
}
