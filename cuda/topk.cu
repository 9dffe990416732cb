// Routing stage: one warp per row (routing.cuh), TOPK_WARPS rows a block. GROUP_REGS (1 for
// group-limited routers): their rows from registers where the groups are whole registers
// (routing.cuh route_row_topk).
#include "common.cuh"
#include "quant.cuh"
#include "routing.cuh"
#include "lora_common.cuh"  // ERR_LORA_ID_RANGE (topk_route_lora)

#define TOPK_WARPS 4

// The row's logits: its split copies' sum, in split order, into copy 0. A lane's four columns a
// round with every copy's load in flight together: a row is R / 128 L2 round trips, not one a copy.
__device__ __forceinline__ void sum_logit_splits(float* __restrict__ logits, int row, int N, int R, int splits,
                                                 int lane) {
    float* l = logits + (size_t)row * R;
    const size_t copy = (size_t)N * R;
    for (int i0 = lane; i0 < R; i0 += 4 * 32) {
        float v[4][ROUTE_MAX_COPIES];
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
            for (int z = 0; z < ROUTE_MAX_COPIES; ++z) {
                const int i = i0 + 32 * c;
                v[c][z] = z < splits && i < R ? l[z * copy + i] : 0.0f;
            }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float sum = v[c][0];
#pragma unroll
            for (int z = 1; z < ROUTE_MAX_COPIES; ++z)
                if (z < splits) sum += v[c][z];
            if (i0 + 32 * c < R) l[i0 + 32 * c] = sum;
        }
    }
    __syncwarp();
}

// topk_route's arguments (topk_route_lora's first):
//   logits [splits, N, R] fp32 (router bias already added); corr_bias [R] or null: selection-only
//   correction bias; tid2eid [V, k] or null: hash routing table; token_ids [N] (hash routing only);
//   ids_out, w_out [N, k]; err: error bits; splits: the split router's copies.
#define TOPK_ROUTE_ARGS                                                                                         \
    float *__restrict__ logits, const float *__restrict__ corr_bias, const int *__restrict__ tid2eid,          \
        const int *__restrict__ token_ids, int *__restrict__ ids_out, float *__restrict__ w_out,               \
        int *__restrict__ err, int N, int R, int E, int k, int scoring, int n_group, int topk_group,           \
        int topk_then_softmax, int renorm, float scale, int vocab, int splits
#define TOPK_ROUTE_ARG_NAMES                                                                                  \
    logits, corr_bias, tid2eid, token_ids, ids_out, w_out, err, N, R, E, k, scoring, n_group, topk_group,     \
        topk_then_softmax, renorm, scale, vocab, splits

// The row's top-k from its logits' copy 0 (its warp's scratch in smem); w8a8 prefill's x codes are
// x_codes_e4m3's, ahead of the router.
// `copies` > 1: a split router's, summed in registers on the register path (route_row_vec), else
// into copy 0 first (sum_logit_splits), the same sums either way.
template <int GROUP_REGS>
__device__ __forceinline__ void route_row(int row, float* smem, int warp, int lane, int copies, TOPK_ROUTE_ARGS) {
    float* scratch = smem + (size_t)warp * (2 * R + TOPK_MAX_K);
    bool done = false;
    if (copies > 1 && vec_route_fits(4, R, k, n_group, tid2eid) && R <= 256) {
        const size_t copy = (size_t)N * R;
        done = R <= 128 ? route_row_vec<1>(row, scratch, logits, corr_bias, ids_out, w_out, R, k, scoring,
                                           topk_then_softmax, renorm, scale, err, lane, nullptr, copies, copy)
                        : route_row_vec<2>(row, scratch, logits, corr_bias, ids_out, w_out, R, k, scoring,
                                           topk_then_softmax, renorm, scale, err, lane, nullptr, copies, copy);
    }
    if (!done) {
        if (copies > 1) sum_logit_splits(logits, row, N, R, copies, lane);
        route_row_topk<4, GROUP_REGS != 0>(row, scratch, logits, corr_bias, tid2eid, token_ids, ids_out, w_out, err,
                                           R, E, k, scoring, n_group, topk_group, topk_then_softmax, renorm, scale,
                                           vocab, lane);
    }
}

template <int GROUP_REGS>
__global__ void __launch_bounds__(TOPK_WARPS * 32, 8)  // 8: 64 registers (ptxas chose 56 and spilled)
topk_route(TOPK_ROUTE_ARGS) {
    extern __shared__ float smem[];
    pdl_wait_then_release_next();  // the decode chain past ROUTE_LISTS_MAX_ROWS launches it by PDL
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * TOPK_WARPS + warp;
    if (row >= N) return;
    route_row<GROUP_REGS>(row, smem, warp, lane, splits, TOPK_ROUTE_ARG_NAMES);
}

// w8a8 prefill: x's e4m3 codes and scales for the fp8 gate/up GEMM ahead of the router, one 256-column
// unit a warp over the whole grid (quant.cuh e4m3_quantize_units), so every unit's load is in flight at
// once; topk_route, one warp a row, then routes only. grid ceil(N * ceil(H / 256) / X_CODES_WARPS).
#define X_CODES_WARPS 8
__global__ void __launch_bounds__(X_CODES_WARPS * 32)
x_codes_e4m3(const bf16* __restrict__ x, int N, int H, u8* __restrict__ qx, float* __restrict__ sx) {
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
#if CUPYMOE_SM >= 89
    e4m3_quantize_units(x, N, H, qx, sx, blockIdx.x * X_CODES_WARPS + (threadIdx.x >> 5), gridDim.x * X_CODES_WARPS,
                        threadIdx.x & 31);
#endif
}

// The router's LoRA delta for the row, where the router GEMM made t beside the logits
// (grouped_gemm_lora<MODE_ROUTER, ...>, forward_plan.with_lora), with the split copies' sum:
// logits[row] = (its copies' sum, in split order) + (s B)_a t, a = lora_ids[row] and t its
// adapter's ranks of lora_t ([splits][N][K][3][R] fp32: A's three bf16 parts, lora_slots.py) summed
// over the splits, then the parts (fp32); the expand in rank order from 0 as lora_router_expand's.
// An id >= max_loras is flagged (and gets no delta), as there. Each lane takes four columns at
// once, every load of theirs in flight together: the row's chain is a few trips, not one a column.
#define LORA_ROUTER_PARTS 3
#define LORA_ROUTER_COLS 4        // columns a lane at once
__device__ __forceinline__ void router_lora_t(float* ts, const float* __restrict__ ta, int N, int cols, int splits,
                                              int max_rank, int lane) {
    for (int r = lane; r < max_rank; r += 32) {
        float v[LORA_ROUTER_PARTS][ROUTE_MAX_COPIES];
#pragma unroll
        for (int p = 0; p < LORA_ROUTER_PARTS; ++p)
#pragma unroll
            for (int z = 0; z < ROUTE_MAX_COPIES; ++z)
                v[p][z] = z < splits ? ta[(size_t)z * N * cols + p * max_rank + r] : 0.f;
        float t = 0.f;
#pragma unroll
        for (int p = 0; p < LORA_ROUTER_PARTS; ++p) {
            float s = 0.f;
#pragma unroll
            for (int z = 0; z < ROUTE_MAX_COPIES; ++z)
                if (z < splits) s += v[p][z];
            t += s;
        }
        ts[r] = t;
    }
}

__device__ __forceinline__ void add_router_lora(float* __restrict__ logits, float* ts, int row, int N, int R,
                                                int splits, const int* __restrict__ lora_ids,
                                                const float* __restrict__ lora_t, const float* __restrict__ bs,
                                                int* __restrict__ err, int max_rank, int max_loras, int lane) {
    constexpr int CC = LORA_ROUTER_COLS;
    const int id = lora_ids[row];
    if (lora_id_invalid(id, max_loras) && lane == 0) atomicOr(err, ERR_LORA_ID_RANGE);
    const bool has = id >= 0 && id < max_loras;
    const int cols = LORA_ROUTER_PARTS * max_loras * max_rank;
    if (has) router_lora_t(ts, lora_t + (size_t)row * cols + (size_t)id * LORA_ROUTER_PARTS * max_rank, N, cols,
                           splits, max_rank, lane);
    __syncwarp();
    float* l = logits + (size_t)row * R;
    for (int i0 = lane; i0 < R; i0 += CC * 32) {
        float v[CC], d[CC];
#pragma unroll
        for (int c = 0; c < CC; ++c) {
            const int i = i0 + 32 * c;
            v[c] = i < R ? l[i] : 0.f;
#pragma unroll
            for (int z = 1; z < ROUTE_MAX_COPIES; ++z)
                if (z < splits && i < R) v[c] += l[(size_t)z * N * R + i];
            d[c] = 0.f;
        }
        for (int j0 = 0; has && j0 < max_rank; j0 += 16) {  // sixteen ranks of s B a column loaded together
            float b[CC][16];
#pragma unroll
            for (int c = 0; c < CC; ++c)
#pragma unroll
                for (int q = 0; q < 16; ++q) {
                    const int i = i0 + 32 * c;
                    b[c][q] = i < R && j0 + q < max_rank ? __ldg(bs + ((size_t)id * R + i) * max_rank + j0 + q) : 0.f;
                }
#pragma unroll
            for (int q = 0; q < 16; ++q)
                if (j0 + q < max_rank)
#pragma unroll
                    for (int c = 0; c < CC; ++c) d[c] = fmaf(b[c][q], ts[j0 + q], d[c]);
        }
#pragma unroll
        for (int c = 0; c < CC; ++c)
            if (i0 + 32 * c < R) l[i0 + 32 * c] = has ? v[c] + d[c] : v[c];
    }
    __syncwarp();
}

// topk_route with the router's LoRA delta added first (add_router_lora): its arguments, then the
// row ids, t, the slots' s B ([max_loras][R][max_rank] fp32) and the slots' shape. Shared memory:
// topk_route's, then max_rank floats a warp.
template <int GROUP_REGS>
__global__ void __launch_bounds__(TOPK_WARPS * 32, 4)  // 4: a lane's 64 loads of s B in flight
topk_route_lora(TOPK_ROUTE_ARGS, const int* __restrict__ lora_ids, const float* __restrict__ lora_t,
                const float* __restrict__ bs, int max_rank, int max_loras) {
    extern __shared__ float smem[];
    pdl_wait_then_release_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * TOPK_WARPS + warp;
    if (row >= N) return;
    float* ts = smem + (size_t)TOPK_WARPS * (2 * R + TOPK_MAX_K) + (size_t)warp * max_rank;
    add_router_lora(logits, ts, row, N, R, splits, lora_ids, lora_t, bs, err, max_rank, max_loras, lane);
    route_row<GROUP_REGS>(row, smem, warp, lane, 1, TOPK_ROUTE_ARG_NAMES);  // (add_router_lora summed the copies)
}

// The experts-only entry's routing stage (MoeLayer.forward_experts): the caller's expert ids
// and weights into the scratch topk_route writes, so every stage after it runs unchanged.
// An id outside 0..R-1 sets ERR_EXPERT_ID_RANGE and goes on as -1 with weight 0, which every
// later stage reads as no expert (no out-of-bounds access). Weights are copied as given. With
// qx (w8a8), x's e4m3 codes too, by the w8a8 rule (quant.cuh). ids_in [N, k] and w_in [N, k]: the
// caller's expert ids and routing weights; ids_out, w_out [N, k]: topk_route's outputs.
#define ROUTE_IN_ARGS                                                                                         \
    const int *__restrict__ ids_in, const float *__restrict__ w_in, int *__restrict__ ids_out,               \
        float *__restrict__ w_out, int *__restrict__ err, int N, int R, int k, const bf16 *__restrict__ x,   \
        int H, u8 *__restrict__ qx, float *__restrict__ sx

__device__ __forceinline__ void route_in_row(int row, int lane, ROUTE_IN_ARGS) {
    for (int j = lane; j < k; j += 32) {
        const size_t p = (size_t)row * k + j;
        const int e = ids_in[p];
        const bool ok = e >= 0 && e < R;
        if (!ok) atomicOr(err, ERR_EXPERT_ID_RANGE);
        ids_out[p] = ok ? e : -1;
        w_out[p] = ok ? w_in[p] : 0.0f;
    }
#if CUPYMOE_SM >= 89
    if (qx) e4m3_quantize_row(x + (size_t)row * H, H, qx + (size_t)row * H, sx + (size_t)row * ((H + 127) >> 7), lane);
#endif
}

// grid ceil(N / TOPK_WARPS), block TOPK_WARPS * 32: one warp a row.
__global__ void __launch_bounds__(TOPK_WARPS * 32) experts_route_in(ROUTE_IN_ARGS) {
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * TOPK_WARPS + warp;
    if (row >= N) return;
    route_in_row(row, lane, ids_in, w_in, ids_out, w_out, err, N, R, k, x, H, qx, sx);
}

// experts_route_in with the rows' adapter slots (lora_ids [N]) checked where no router delta runs to
// do it: an id outside -1..max_loras-1 sets ERR_LORA_ID_RANGE (the experts' delta kernels add nothing for it).
__global__ void __launch_bounds__(TOPK_WARPS * 32)
experts_route_in_lora(ROUTE_IN_ARGS, const int* __restrict__ lora_ids, int max_loras) {
    pdl_wait_then_release_next();  // as experts_route_in
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * TOPK_WARPS + warp;
    if (row >= N) return;
    route_in_row(row, lane, ids_in, w_in, ids_out, w_out, err, N, R, k, x, H, qx, sx);
    if (lane == 0 && lora_id_invalid(lora_ids[row], max_loras)) atomicOr(err, ERR_LORA_ID_RANGE);
}
