// Hopper (sm_90a) grouped GEMM, warp-specialized and persistent.
//
// The tiles, modes, arguments and epilogues of grouped_sm90.cu (gemm_common.cuh), the work
// split by role instead of every warp doing everything:
//   warpgroup 0      producer: cp.async copies of A (gathered rows) and B into a ring of
//                    STAGES stages, one stage a K step; it waits for a stage to be empty
//                    and marks it full once its own copies have landed;
//   warpgroups 1, 2  consumers: 64 rows each, m64nBNk16 wgmmas from a full stage, which
//                    they mark empty when those wgmmas are done; then the tile's epilogue.
// One block per SM walks the tiles blockIdx.x, + gridDim.x, ... (column tile fastest), and
// the producer runs ahead across tile boundaries: the next tile's first stages arrive
// while the consumers run this one's epilogue, which is what one block per SM could not
// hide before (NOTES.md v10 / v11).
//
// Handshakes are mbarriers in shared memory. full[s]: 128 producer arrivals per use; each
// producer thread arrives after cp.async.wait_group has seen its copies of that stage land
// and fence.proxy.async has made them visible to the wgmma (async) proxy. empty[s]: one
// arrival per consumer warp per use. A stage's n-th use completes phase n of each barrier,
// so the waits take the parity of (step / STAGES).
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define WS_BM 128
#define WS_BK 64
#define WS_THREADS 384  // producer warpgroup + 2 consumer warpgroups
#define WS_LAG 2        // a producer thread signals step t once it has issued step t + WS_LAG

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}
// Column tiles of a mode's output: BN / 2 gate + BN / 2 up columns, or BN down / router ones.
template <int MODE, int BN>
__device__ __forceinline__ int ws_column_tiles(int H, int I_max) {
    return MODE == MODE_GATE_UP ? (I_max + BN / 2 - 1) / (BN / 2) : ((MODE == MODE_DOWN ? H : I_max) + BN - 1) / BN;
}

// The next tile with work at or after linear index L, L advancing by `stride`; false when
// none is left. Producer and consumers walk the same sequence.
template <int MODE, int BN>
__device__ __forceinline__ bool ws_next_tile(GemmTile& t, int& L, int stride, int cols, int total, GEMM_ARGS) {
    for (; L < total; L += stride)
        if (gemm_tile_at<MODE, WS_BM, BN>(t, L % cols, L / cols, GEMM_ARG_NAMES)) return true;
    return false;
}

// grid (persistent blocks <= SMs), block 384, dynamic smem kernels.sm90_ws_smem_bytes(STAGES, BN).
template <int MODE, int STAGES, int BN>
__global__ void __launch_bounds__(WS_THREADS, 1)
grouped_gemm_sm90_ws(GEMM_ARGS) {
    constexpr int BM = WS_BM, BK = WS_BK, S = STAGES, NACC = BN / 2;
    static_assert(BK == 64, "wgmma_k64_bf16 takes 64-wide K steps");
    // a consumer frees step u's stage once step u + 1 is full, which the producer signals
    // after issuing step u + 1 + WS_LAG: that must not wait for step u's stage itself
    static_assert(S >= WS_LAG + 2, "too few stages for the producer's lag");
    extern __shared__ __align__(1024) unsigned char ws_smem[];
    const unsigned pad = (1024u - (smem_u32(ws_smem) & 1023u)) & 1023u;
    bf16* sA = reinterpret_cast<bf16*>(ws_smem + pad);
    bf16* sB = sA + S * BM * BK;
    u64* full = reinterpret_cast<u64*>(sB + S * BN * BK);
    u64* empty = full + S;
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(&full[s], 128);  // every producer thread, once per use
            mbar_init(&empty[s], 8);   // every consumer warp, once per use
        }
    }
    __syncthreads();

    const int cols = ws_column_tiles<MODE, BN>(H, I_max);
    const int total = cols * (MODE == MODE_ROUTER ? (P + BM - 1) / BM : *num_tiles);
    const int stride = gridDim.x;
    GemmTile t;
    int L = blockIdx.x;
    const int wg = threadIdx.x / 128;

    if (wg == 0) {  // ---- producer ----
        TileLoader<MODE, BM, BK, 128, BN> ld;
        int step = 0;  // K steps issued by this thread, over all tiles
        while (ws_next_tile<MODE, BN>(t, L, stride, cols, total, GEMM_ARG_NAMES)) {
            ld.init(t, GEMM_ARG_NAMES);
            const int KT = (t.K + BK - 1) / BK;
            for (int kt = 0; kt < KT; ++kt, ++step) {
                const int slot = step % S;
                if (step >= S) mbar_wait(&empty[slot], ((step / S) + 1) & 1);  // its previous use is done
                ld.load(sA + slot * BM * BK, sB + slot * BN * BK, kt * BK, t.K);
                cp_async_commit();
                if (step >= WS_LAG) {  // step - WS_LAG has landed: visible to wgmma, full
                    cp_async_wait<WS_LAG>();
                    fence_proxy_async();
                    mbar_arrive(&full[(step - WS_LAG) % S]);
                }
            }
            L += stride;
        }
        cp_async_wait<0>();  // the last steps' copies
        fence_proxy_async();
        for (int u = max(0, step - WS_LAG); u < step; ++u) mbar_arrive(&full[u % S]);
        return;
    }

    // ---- consumers: warpgroup 1 rows 0..63, warpgroup 2 rows 64..127 ----
    const int cw = wg - 1;
    const int lane = threadIdx.x & 31;
    float d[NACC];
    int step = 0;
    while (ws_next_tile<MODE, BN>(t, L, stride, cols, total, GEMM_ARG_NAMES)) {
#pragma unroll
        for (int i = 0; i < NACC; ++i) d[i] = 0.0f;
        const int KT = (t.K + BK - 1) / BK;
        for (int kt = 0; kt < KT; ++kt, ++step) {
            const int slot = step % S;
            mbar_wait(&full[slot], (step / S) & 1);
            const u64 da = wgmma_desc(sA + slot * BM * BK + cw * 64 * BK);
            const u64 db = wgmma_desc(sB + slot * BN * BK);
            wgmma_k64_bf16<BN>(d, da, db);
            wgmma_wait<1>();  // this warpgroup's previous step is done: free its stage
            if (kt > 0 && lane == 0) mbar_arrive(&empty[(step - 1) % S]);
        }
        wgmma_wait<0>();
        fence_acc<NACC>(d);
        if (lane == 0) mbar_arrive(&empty[(step - 1) % S]);

        emit_wgmma_rows<MODE, BN>(t, d, cw * 64, GEMM_ARG_NAMES);
        L += stride;
    }
}
