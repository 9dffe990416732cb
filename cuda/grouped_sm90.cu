// Hopper (sm_90a) grouped GEMM: wgmma.mma_async with both operands in shared memory.
//
// Same tiles, modes, arguments and epilogues as grouped.cu's mma.sync kernel
// (gemm_common.cuh); here 2 warpgroups each own 64 rows of a 128 x BN tile and issue
// m64nBNk16 wgmmas from 128-byte-swizzled K-major tiles (64-wide K steps: one 128-byte
// row per tile row, exactly the swizzle atom), fed by a cp.async pipeline of STAGES
// stages (kernels.SM90_VARIANTS). One wgmma batch stays in flight while the next stage is
// loaded. fp4 weights (FMT nvfp4 / mxfp4, 128-wide tiles) arrive raw in a ring of their own
// (QuantBLoader) and the thread that copied a chunk turns it into the stage's bf16 B tile
// (exact: quant.cuh) right before the step that reads it. cp.async writes through
// the generic proxy and wgmma reads through the async proxy: each thread fences
// (fence.proxy.async) after its copies land and before the barrier.
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define SM90_BM 128
#define SM90_BK 64
#define SM90_THREADS 256

// grid (column tiles, M-tiles of 128 rows), block 256, dynamic smem kernels.sm90_smem_bytes().
// Template: kernels.SM90_VARIANTS. BN: weight rows per tile (128, or 256: twice the math
// per byte of A and of shared memory read, 128 accumulators a thread, one block per SM);
// BLOCKS_PER_SM 1 with a deep pipeline, 2 with a shallow one. FMT: the weights' format.
template <int MODE, int STAGES, int BLOCKS_PER_SM, int BN, int FMT = FMT_BF16>
__global__ void __launch_bounds__(SM90_THREADS, BLOCKS_PER_SM)
grouped_gemm_sm90(GEMM_ARGS) {
    constexpr int BM = SM90_BM, BK = SM90_BK, S = STAGES, NACC = BN / 2;
    constexpr bool QUANT = FMT != FMT_BF16;
    static_assert(BK == 64, "wgmma_k64_bf16 takes 64-wide K steps");
    static_assert(!QUANT || BN == GG_BN, "QuantBLoader fills GG_BN-row tiles");
    extern __shared__ __align__(1024) unsigned char sm90_smem[];
    // the swizzle atoms must start on 1024-byte boundaries of the shared window
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(sm90_smem) & 1023u)) & 1023u;
    bf16* sA = reinterpret_cast<bf16*>(sm90_smem + pad);
    bf16* sB = sA + S * BM * BK;
    u8* sRaw = reinterpret_cast<u8*>(sB + S * BN * BK);  // quantized: the raw code stages
    GemmTile t;
    if (!gemm_tile<MODE, BM, BN, FMT>(t, GEMM_ARG_NAMES)) return;
    typedef StageLoader<MODE, BM, BK, SM90_THREADS, BN, FMT> Loader;
    Loader ld;
    ld.init(t, GEMM_ARG_NAMES);
    auto load_stage = [&](int s, int k0) {
        ld.load(sA + s * BM * BK, sB + s * BN * BK, sRaw + s * Loader::RAW_STAGE, t.k_lo + k0, t.K);
    };
    const int wg = threadIdx.x / 128;
    // a run's last tile often holds fewer than 64 rows: the second warpgroup then issues no
    // wgmmas (the tensor cores go to the other block on the SM) but keeps the barriers
    const bool has_rows = wg * 64 < t.rows;

    float d[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) d[i] = 0.0f;

    const int KT = (t.K - t.k_lo + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < KT) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<S - 2>();  // this thread's copies of stage kt have landed
        // quantized: its raw chunks become the stage's bf16 B tile, last read by the wgmmas
        // of step kt - S, which the wait of step kt - 1 saw done
        ld.convert(sRaw + (kt % S) * Loader::RAW_STAGE, sB + (kt % S) * BN * BK, t.k_lo + kt * BK, t.K);
        fence_proxy_async();     // ... and are visible to the tensor cores' (async) proxy
        __syncthreads();         // everyone's copies of stage kt
        const u64 da = wgmma_desc(sA + (kt % S) * BM * BK + wg * 64 * BK);
        const u64 db = wgmma_desc(sB + (kt % S) * BN * BK);
        if (has_rows) wgmma_k64_bf16<BN>(d, da, db);
        wgmma_wait<1>();  // this warpgroup's batch kt - 1 is done ...
        __syncthreads();  // ... and the other's: its stage slot is free
        const int kn = kt + S - 1;
        if (kn < KT) load_stage(kn % S, kn * BK);
        cp_async_commit();
    }
    wgmma_wait<0>();
    fence_acc<NACC>(d);
    cp_async_wait<0>();

    if (!has_rows) return;
    if (MODE == MODE_DOWN) {  // the output through this warpgroup's A blocks, 16-byte stores
        float w[2];
        down_row_weights(w, t, wg * 64, GEMM_ARG_NAMES);
        emit_wgmma_down_staged<BN, S>(t, d, w, wg * 64, sA + wg * 64 * BK, BM * BK, GEMM_ARG_NAMES);
    }
    else
        emit_wgmma_rows<MODE, BN>(t, d, wg * 64, GEMM_ARG_NAMES);
}
