// Hopper (sm_90a) grouped GEMM: wgmma.mma_async with both operands in shared memory.
//
// Same tiles, modes, arguments and epilogues as grouped.cu's mma.sync kernel
// (gemm_common.cuh); here 2 warpgroups each own 64 rows of a 128 x 128 tile and issue
// m64n128k16 wgmmas from 128-byte-swizzled K-major tiles (64-wide K steps: one 128-byte
// row per tile row, exactly the swizzle atom), fed by a cp.async pipeline of STAGES stages (kernels.SM90_VARIANTS). One
// wgmma batch stays in flight while the next stage is loaded. cp.async writes through
// the generic proxy and wgmma reads through the async proxy: each thread fences
// (fence.proxy.async) after its copies land and before the barrier.
#include "gemm_common.cuh"
#include "wgmma.cuh"

#define SM90_BM 128
#define SM90_BK 64
#define SM90_THREADS 256

// d[64] (m64 x n128, fp32) += A (64 x 16, bf16) * B (16 x 128, bf16), both from shared memory.
__device__ __forceinline__ void wgmma_m64n128k16(float* d, u64 da, u64 db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
}

// Column tiles of a mode's output: 64 gate + 64 up columns, or 128 down / router columns.
template <int MODE>
__device__ __forceinline__ int sm90_column_tiles(int H, int I_max) {
    return MODE == MODE_GATE_UP ? (I_max + GG_BN / 2 - 1) / (GG_BN / 2) : ((MODE == MODE_DOWN ? H : I_max) + GG_BN - 1) / GG_BN;
}

// The next tile with work at or after linear index L (column tile fastest), L advancing by
// `stride`; false when none is left.
template <int MODE>
__device__ __forceinline__ bool sm90_next_tile(GemmTile& t, int& L, int stride, int cols, int total, GEMM_ARGS) {
    for (; L < total; L += stride)
        if (gemm_tile_at<MODE, SM90_BM, GG_BN>(t, L % cols, L / cols, GEMM_ARG_NAMES)) return true;
    return false;
}

// Launch: either one block per tile, grid (column tiles, M-tile bound), or persistent, grid
// (blocks, 1) with blocks <= resident blocks: each block then walks the tiles
// blockIdx.x, + gridDim.x, ... The K steps of a block's tiles form one stream through the
// pipeline: the loads run STAGES - 1 steps ahead across tile boundaries, so the next
// tile's first stages arrive while this one's epilogue runs. Block 256, dynamic smem
// kernels.sm90_smem_bytes(STAGES); BLOCKS_PER_SM: 1 with a deep pipeline, 2 with a
// shallow one (kernels.SM90_VARIANTS).
template <int MODE, int STAGES, int BLOCKS_PER_SM>
__global__ void __launch_bounds__(SM90_THREADS, BLOCKS_PER_SM)
grouped_gemm_sm90(GEMM_ARGS) {
    constexpr int BM = SM90_BM, BK = SM90_BK, S = STAGES;
    extern __shared__ __align__(1024) unsigned char sm90_smem[];
    // the swizzle atoms must start on 1024-byte boundaries of the shared window
    const unsigned pad = (1024u - ((unsigned)__cvta_generic_to_shared(sm90_smem) & 1023u)) & 1023u;
    bf16* sA = reinterpret_cast<bf16*>(sm90_smem + pad);
    bf16* sB = sA + S * BM * BK;

    const int cols = sm90_column_tiles<MODE>(H, I_max);
    const int total = cols * (MODE == MODE_ROUTER ? (P + BM - 1) / BM : *num_tiles);
    const int stride = gridDim.x * gridDim.y;
    GemmTile t;  // the tile being computed
    int L = blockIdx.y * gridDim.x + blockIdx.x;
    if (!sm90_next_tile<MODE>(t, L, stride, cols, total, GEMM_ARG_NAMES)) return;

    // the load cursor: tile L_ld (its loader, K and steps), step kt_ld
    TileLoader<MODE, BM, BK, SM90_THREADS> ld;
    ld.init(t, GEMM_ARG_NAMES);
    int L_ld = L, K_ld = t.K, KT_ld = (t.K + BK - 1) / BK, kt_ld = 0;
    bool loading = true;
    // copy the cursor's step into stage `slot` and advance it, into the next tile if need be
    auto load_next = [&](int slot) {
        if (loading) {
            ld.load(sA + slot * BM * BK, sB + slot * GG_BN * BK, kt_ld * BK, K_ld);
            if (++kt_ld == KT_ld) {
                GemmTile n;
                L_ld += stride;
                loading = sm90_next_tile<MODE>(n, L_ld, stride, cols, total, GEMM_ARG_NAMES);
                if (loading) {
                    ld.init(n, GEMM_ARG_NAMES);
                    K_ld = n.K, KT_ld = (n.K + BK - 1) / BK, kt_ld = 0;
                }
            }
        }
        cp_async_commit();  // one group per step, empty or not: the waits count steps
    };
#pragma unroll
    for (int s = 0; s < S - 1; ++s) load_next(s);

    const int wg = threadIdx.x / 128;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    float d[64];
    int step = 0;  // steps computed by this block, over all its tiles: the stage is step % S
    for (;;) {
#pragma unroll
        for (int i = 0; i < 64; ++i) d[i] = 0.0f;
        const int KT = (t.K + BK - 1) / BK;
        for (int kt = 0; kt < KT; ++kt, ++step) {
            cp_async_wait<S - 2>();  // this thread's copies of this step have landed
            fence_proxy_async();     // ... and are visible to the tensor cores' (async) proxy
            __syncthreads();         // everyone's copies of this step
            const int slot = step % S;
            const u64 da = wgmma_desc(sA + slot * BM * BK + wg * 64 * BK);
            const u64 db = wgmma_desc(sB + slot * GG_BN * BK);
            fence_acc(d);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64n128k16(d, da + kk * 2, db + kk * 2);  // +32 bytes per k16
            wgmma_commit();
            fence_acc(d);
            wgmma_wait<1>();  // this warpgroup's previous step is done ...
            __syncthreads();  // ... and the other's: its stage is free
            load_next((step + S - 1) % S);
        }
        wgmma_wait<0>();
        fence_acc(d);

        // Accumulator d[j * 4 + h * 2 + e]: row 16 * warp + g + 8 h of the warpgroup's 64,
        // column 8 j + 2 t4 + e (the m16n8 fragment layout, one per 8-column block j).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wg * 64 + warp * 16 + g + 8 * h;
            if (MODE == MODE_GATE_UP) {
#pragma unroll
                for (int j = 0; j < 8; ++j)  // gate columns in blocks 0..7, up columns in 8..15
                    emit_gate_up(t, r, j * 8 + 2 * t4, d[j * 4 + h * 2], d[j * 4 + h * 2 + 1], d[(j + 8) * 4 + h * 2],
                                 d[(j + 8) * 4 + h * 2 + 1], GEMM_ARG_NAMES);
            } else {
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    emit_out<MODE>(t, r, j * 8 + 2 * t4, d[j * 4 + h * 2], d[j * 4 + h * 2 + 1], GEMM_ARG_NAMES);
            }
        }
        L += stride;
        if (!sm90_next_tile<MODE>(t, L, stride, cols, total, GEMM_ARG_NAMES)) break;
    }
    cp_async_wait<0>();
}
