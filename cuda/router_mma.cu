// The decode path's router on tensor cores (sm_90a): logits[n, r] = x[n, :] . W[r, :]
// (+ bias[r]), bf16 products summed in fp32 by mma.sync m16n8k16, the router's columns as M
// and x's rows as N.
//
//   router_logits_mma<NT>  a block: RM_COLS router columns x NT * 8 rows of x x 1/RM_CLUSTER
//                          of K; grid (ceil(R / RM_COLS), RM_CLUSTER, ceil(N / (8 NT)))
//   router_logits_split<NT> a block: RM_COLS columns x NT * 8 rows x 1/S of K, its sum into
//                          logits copy S (no cluster); grid (ceil(R / RM_COLS), S, ceil(N / (8 NT)));
//                          top-k sums the S copies in split order (topk.cu sum_logit_splits)
//
// Why: the CUDA-core router (router.cu) reads x once per two router columns: at deepseek-v3
// N = 64 its 1024 blocks read 117 MB of x from L2 for a 3.7 MB matrix.
// Here a warp takes 16 router columns and all the block's rows, so x is read once per 32
// columns, and K is split over a cluster's blocks and a block's warps so much of the matrix
// is in flight at once. The partial sums meet in a fixed order (warps by a tree in shared
// memory, then the cluster's blocks through distributed shared memory, rank 0 first), and
// every element's sum runs over the same K split whatever the row tile, so a row's logits
// are the same bits alone or in any batch (tested). At few rows or a narrow router the
// CUDA-core kernel is as fast (layer.DECODE_ROUTER_MMA_MIN_MACS).
//
// K order: lane (g, t) loads 16 contiguous bytes at column 32 s + 8 t of its rows (weight rows
// g and g + 8 of the warp's tile; x row g of each n8 tile) and feeds elements 0-3 to the first
// k16 MMA of step s (K slots 2 t, 2 t + 1, 2 t + 8, 2 t + 9) and 4-7 to the second: A and B
// take the same permutation of K, so each MMA sums true products.
#include "common.cuh"
#include "gemm_common.cuh"
#include "quant.cuh"

#define RM_COLS 32                        // router columns a block: two m16 tiles, a column warp each
#define RM_KWARPS 8                       // warps of a block splitting its K share (a power of two)
#define RM_CLUSTER 8                      // blocks of a cluster splitting K (the portable maximum)
#define RM_THREADS (2 * RM_KWARPS * 32)   // 512
#define RM_KSTEP 32                       // K columns of a step: two k16 MMAs
// steps whose loads a warp issues before their MMAs (one at 64 rows: 128 registers a thread)
#define RM_UNROLL(NT) ((NT) >= 8 ? 1 : 2)

#if CUPYMOE_SM >= 90
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// every thread of the cluster arrives; release / acquire order the shared-memory writes
// before it against the other blocks' reads after it
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// a float of block `rank`'s shared memory at this block's address `p`
__device__ __forceinline__ float ld_cluster_f32(const float* p, unsigned rank) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

__device__ __forceinline__ uint4 rm_load_stream(const bf16* p) { return load_bf16x8_stream(p).raw; }

// A warp's sums over its k32 steps first, first + stride, ... below s_end, of the 16 router
// columns from col0 and NT * 8 rows from row0, into its NT * 4 accumulators, U steps' loads in
// flight before their MMAs (lane (g, t)'s K order: the file's head).
template <int NT>
__device__ __forceinline__ void rm_warp_sums(float* acc, const bf16* __restrict__ x, const bf16* __restrict__ W,
                                             int N, int R, int H, int col0, int row0, int first, int s_end,
                                             int stride, int lane) {
    constexpr int U = RM_UNROLL(NT);
    const int g = lane >> 2, t = lane & 3;
    // past R or N: a valid row's values, never stored
    const bf16* w_lo = W + (size_t)min(col0 + g, R - 1) * H;
    const bf16* w_hi = W + (size_t)min(col0 + g + 8, R - 1) * H;
    const bf16* xr[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) xr[n] = x + (size_t)min(row0 + n * 8 + g, N - 1) * H;
#pragma unroll
    for (int i = 0; i < NT * 4; ++i) acc[i] = 0.0f;
#pragma unroll 1
    for (int s0 = first; s0 < s_end; s0 += U * stride) {
        uint4 a[U][2], b[U][NT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u * stride, k = s * RM_KSTEP + 8 * t;
            const bool in = s < s_end && k < H;  // H % 8 == 0: a lane's 8 columns are all in or all out
            a[u][0] = in ? rm_load_stream(w_lo + k) : make_uint4(0, 0, 0, 0);
            a[u][1] = in ? rm_load_stream(w_hi + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int n = 0; n < NT; ++n)
                b[u][n] = in ? __ldg(reinterpret_cast<const uint4*>(xr[n] + k)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned a0[4] = {a[u][0].x, a[u][1].x, a[u][0].y, a[u][1].y};
            const unsigned a1[4] = {a[u][0].z, a[u][1].z, a[u][0].w, a[u][1].w};
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                mma_bf16(acc + 4 * n, a0, b[u][n].x, b[u][n].y);
                mma_bf16(acc + 4 * n, a1, b[u][n].z, b[u][n].w);
            }
        }
    }
}

// w8a8 (qx set): x's e4m3 codes too, as router_logits_bf16 makes them (256 columns a warp's unit,
// dealt over every warp of the grid)
__device__ __forceinline__ void rm_quantize_x(const bf16* __restrict__ x, int N, int H, u8* __restrict__ qx,
                                              float* __restrict__ sx, int warp, int lane) {
    if (!qx) return;
    const int blocks = gridDim.x * gridDim.y * gridDim.z;
    const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    e4m3_quantize_units(x, N, H, qx, sx, block + blocks * warp, blocks * (RM_THREADS / 32), lane);
}

template <int NT>
__global__ void __cluster_dims__(1, RM_CLUSTER, 1) __launch_bounds__(RM_THREADS, 1)
router_logits_mma(const bf16* __restrict__ x, const bf16* __restrict__ W, const float* __restrict__ bias,
                  float* __restrict__ logits, int N, int R, int H, u8* __restrict__ qx, float* __restrict__ sx) {
    constexpr int ACC = NT * 4;  // a lane's accumulators: NT n8 tiles x the m16n8 fragment's 4
    // the warps' partial sums for the tree (a slot a pair of warps, lane-minor: no bank conflicts)
    __shared__ float tree[RM_KWARPS / 2][2][ACC * 32];
    __shared__ float block_sum[2][ACC * 32];  // the block's sums, which the cluster reads
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ct = warp / RM_KWARPS, kw = warp % RM_KWARPS;  // column tile, K share of the block
    const unsigned rank = cluster_rank();
    const int row0 = blockIdx.z * NT * 8;
    float acc[ACC];
    const int steps = (H + RM_KSTEP - 1) / RM_KSTEP;
    rm_warp_sums<NT>(acc, x, W, N, R, H, blockIdx.x * RM_COLS + ct * 16, row0, (int)rank * RM_KWARPS + kw, steps,
                     RM_CLUSTER * RM_KWARPS, lane);

    // the block's K shares: a tree over its warps, halves added into the lower half
#pragma unroll
    for (int half = RM_KWARPS / 2; half >= 1; half /= 2) {
        if (kw >= half && kw < 2 * half) {
#pragma unroll
            for (int i = 0; i < ACC; ++i) tree[kw - half][ct][i * 32 + lane] = acc[i];
        }
        __syncthreads();
        if (kw < half) {
#pragma unroll
            for (int i = 0; i < ACC; ++i) acc[i] += tree[kw][ct][i * 32 + lane];
        }
        __syncthreads();
    }
    if (kw == 0) {
#pragma unroll
        for (int i = 0; i < ACC; ++i) block_sum[ct][i * 32 + lane] = acc[i];
    }
    cluster_sync();

    // the cluster's sums, ranks in order: this block finishes 1/RM_CLUSTER of the elements
    constexpr int ELEMS = 2 * ACC * 32, MINE = ELEMS / RM_CLUSTER;
    static_assert(ELEMS % RM_CLUSTER == 0, "the cluster's blocks share the elements evenly");
    for (int e = (int)rank * MINE + threadIdx.x; e < ((int)rank + 1) * MINE; e += RM_THREADS) {
        float v = 0.0f;
#pragma unroll
        for (unsigned r = 0; r < RM_CLUSTER; ++r) v += ld_cluster_f32(&block_sum[0][0] + e, r);
        // element e: column tile, accumulator i (n8 tile i / 4, fragment entry i % 4), lane
        const int c_tile = e / (ACC * 32), i = (e / 32) % ACC, l = e % 32;
        const int q = i % 4;
        const int col = blockIdx.x * RM_COLS + c_tile * 16 + (l >> 2) + (q >= 2 ? 8 : 0);
        const int row = row0 + (i / 4) * 8 + 2 * (l & 3) + (q & 1);
        if (col < R && row < N) logits[(size_t)row * R + col] = v + (bias ? bias[col] : 0.0f);
    }
    cluster_sync();  // no block leaves while the others still read its sums

    rm_quantize_x(x, N, H, qx, sx, warp, lane);
}

// K split over the grid's y blocks, each sum one logits copy, instead of a cluster: the block's
// warps meet once in shared memory (K warp 0 adds the others in order) and nothing waits on
// another block, so the kernel's fixed cost is one load round trip and one barrier. S is fixed by
// H (catalog.router_split_copies), so an element's order of additions (a warp's steps in order,
// the block's K warps in order, the copies in order) never depends on N.
template <int NT>
__global__ void __launch_bounds__(RM_THREADS, 1)
router_logits_split(const bf16* __restrict__ x, const bf16* __restrict__ W, const float* __restrict__ bias,
                    float* __restrict__ logits, int N, int R, int H, u8* __restrict__ qx, float* __restrict__ sx) {
    constexpr int ACC = NT * 4;
    __shared__ float part[RM_KWARPS - 1][2][ACC * 32];  // K warps 1.. : their sums, lane-minor
    pdl_wait_then_release_next();  // (the chain's first kernel: only the release does anything)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ct = warp / RM_KWARPS, kw = warp % RM_KWARPS;
    const int col0 = blockIdx.x * RM_COLS + ct * 16, row0 = blockIdx.z * NT * 8;
    float acc[ACC];
    const int steps = (H + RM_KSTEP - 1) / RM_KSTEP, share = (steps + gridDim.y - 1) / gridDim.y;
    const int s_begin = blockIdx.y * share, s_end = min(steps, s_begin + share);
    rm_warp_sums<NT>(acc, x, W, N, R, H, col0, row0, s_begin + kw, s_end, RM_KWARPS, lane);

    if (kw > 0) {
#pragma unroll
        for (int i = 0; i < ACC; ++i) part[kw - 1][ct][i * 32 + lane] = acc[i];
    }
    __syncthreads();
    if (kw == 0) {
#pragma unroll 1
        for (int j = 0; j < RM_KWARPS - 1; ++j)
#pragma unroll
            for (int i = 0; i < ACC; ++i) acc[i] += part[j][ct][i * 32 + lane];
        float* copy = logits + (size_t)blockIdx.y * N * R;
#pragma unroll
        for (int i = 0; i < ACC; ++i) {  // fragment entry q of n8 tile i / 4 (router_logits_mma's map)
            const int q = i % 4;
            const int col = col0 + g + (q >= 2 ? 8 : 0), row = row0 + (i / 4) * 8 + 2 * t + (q & 1);
            if (col < R && row < N) copy[(size_t)row * R + col] = acc[i] + (bias && blockIdx.y == 0 ? bias[col] : 0.0f);
        }
    }

    rm_quantize_x(x, N, H, qx, sx, warp, lane);
}
#endif
